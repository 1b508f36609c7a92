"""The statement backend's prepared statements keep one plan each (PostgreSQL).

Left to choose, PostgreSQL planned the claim anew on every call once labels
were in it (``backends/postgres.py``, ``plan_once``): these tests read the
session's own prepared statements to see how each was planned.
"""

import pytest
from django.db import connection, connections
from django.test import override_settings

from jobs import transitions
from jobs.transitions.backends import statements
from jobs.transitions.backends.postgres import native
from tests.support.factories import T0, make_batch

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


@pytest.fixture(autouse=True)
def statement_backend(settings):
    """Only the statement backend prepares statements: the run of the suite
    with ``RECALL_TRANSITIONS_BACKEND=orm`` has none to plan."""
    if settings.RECALL_TRANSITIONS_BACKEND == "orm":
        pytest.skip("the ORM backend prepares no statements")


LABELS = {"gpu": "a100", "model": "large-v3"}


def plans() -> dict[str, tuple[int, int]]:
    """This session's prepared statements: text -> (generic plans, custom plans)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        )
        return {text: (generic, custom) for text, generic, custom in cursor.fetchall()}


def executions(found: dict[str, tuple[int, int]], start: str) -> int:
    return sum(g + c for text, (g, c) in found.items() if text.startswith(start))


def test_claims_and_completions_with_labels_are_never_planned_again(worker):
    open_to_all = make_batch(30, name="any")
    routed = make_batch(30, name="routed")
    transitions.set_requires(routed, {"gpu": "a100"}, now=T0)
    before = plans()

    for _ in range(30):
        job = transitions.claim_next(worker, labels=LABELS, now=T0)
        transitions.complete(job, job.lease_token, worker=worker, result={"text": "ok"})

    after = plans()
    # Both batches served in turn (fair share between equal priorities).
    assert open_to_all.counts()["done"] == routed.counts()["done"] == 15
    claims = executions(after, "WITH chores") - executions(before, "WITH chores")
    assert claims == 30
    # Every execution ran the one generic plan: none was planned with its values.
    assert {text[:40]: custom for text, (_, custom) in after.items() if custom} == {}


def runs(name: str) -> int:
    """Executions of the statement backend's statement ``name`` in this session."""
    text = native(getattr(statements, name))[0].decode()
    return sum(g + c for found, (g, c) in plans().items() if found == text)


def test_a_claim_without_a_rival_batch_runs_the_lean_statement(worker):
    """Each execution sets up every node of its plan, whether it runs them
    or not: CLAIM_FIRST's walk for a free share and its charge of the
    batch's share are a third of its plan, and a claim from a batch without
    a rival (the only open batch, or the only one of its priority) needs
    neither. Once a claim for these labels found no rival, the next one
    takes CLAIM_SOLO; once that finds a rival, it writes nothing and the
    claim charges shares again, taking the jobs CLAIM_FIRST alone would."""
    alone = make_batch(6, name="alone")
    charged = alone.virtual_time
    for _ in range(3):
        assert transitions.claim_next(worker, now=T0).batch_id == alone.pk
    assert (runs("CLAIM_FIRST"), runs("CLAIM_SOLO")) == (1, 2)
    alone.refresh_from_db()
    assert alone.virtual_time == charged  # no rival: no share to charge

    rival = make_batch(6, name="rival")
    taken = [transitions.claim_next(worker, now=T0).batch_id for _ in range(4)]
    assert taken == [alone.pk, rival.pk, alone.pk, rival.pk]
    # The first of the four tried CLAIM_SOLO, which found the rival.
    assert (runs("CLAIM_FIRST"), runs("CLAIM_SOLO")) == (5, 3)
    alone.refresh_from_db()
    assert alone.virtual_time > charged


def test_a_new_connection_keeps_generic_plans_only_when_statements_are_prepared():
    def mode() -> str:
        fresh = connections.create_connection("default")
        try:
            with fresh.cursor() as cursor:
                cursor.execute("SHOW plan_cache_mode")
                return cursor.fetchone()[0]
        finally:
            fresh.close()

    assert mode() == "force_generic_plan"
    with override_settings(RECALL_PREPARED_STATEMENTS=False):
        assert mode() == "auto"
    with override_settings(RECALL_TRANSITIONS_BACKEND="orm"):
        assert mode() == "auto"


def analyze(*tables: str, replan: bool = False) -> None:
    """Statistics of ``tables`` taken now; with ``replan``, this session's
    prepared statements dropped, so that each is planned again for them."""
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f"ANALYZE {table}")
        if replan:
            cursor.execute("DEALLOCATE ALL")


def rows_read(table: str) -> int:
    """Rows of ``table`` this transaction has read, by scans and indexes."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq_tup_read + COALESCE(idx_tup_fetch, 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = %s",
            [table],
        )
        return cursor.fetchone()[0]


def finish(worker, n: int) -> None:
    """``n`` jobs claimed and completed by ``worker``."""
    for _ in range(n):
        job = transitions.claim_next(worker, now=T0)
        transitions.complete(job, job.lease_token, worker=worker, result={"text": "ok"})


def claim(worker, labels, many: bool) -> int:
    """Jobs leased by one claim (of one job, or of up to 8)."""
    if many:
        return len(transitions.claim_many(worker, labels=labels, max_jobs=8, now=T0))
    return int(transitions.claim_next(worker, labels=labels, now=T0) is not None)


@pytest.mark.parametrize("many", [False, True], ids=["one", "many"])
@pytest.mark.parametrize("labels", [None, LABELS], ids=["no-labels", "labels"])
def test_a_claim_walks_the_claim_index_in_order_whatever_the_queue(
    worker, labels, many
):
    """The generic plan must take the oldest claimable jobs from the claim
    index and stop: planned for a label test it guessed that almost no job
    passes, so it read every job of the table, joined each queued one to its
    item and sorted them, for each claim (2,004 rows read per claim here; in
    a batch of a million queued jobs, a million)."""
    make_batch(1_000, name="big")
    finish(worker, 500)  # a batch half done, as most are for most of their life
    analyze("jobs_job", "batches_batch")
    for _ in range(3):  # prepared, and planned the one time it will be
        assert claim(worker, labels, many)

    leased = 8 if many else 1
    before = rows_read("jobs_job")
    assert claim(worker, labels, many) == leased
    # A handful of rows per job leased (the job, its checks), not the table.
    assert rows_read("jobs_job") - before < 10 * leased


def batches_read_by_a_charged_claim(worker, *, ahead: int, queued: int) -> int:
    """Rows of the batches table one claim reads, made behind ``ahead`` open
    batches that require a GPU the worker lacks (always ahead: nobody claims
    from them), from one of two served batches of ``queued`` jobs each (so
    it is charged to its share), planned for these tables as they are."""
    for n in range(ahead):
        transitions.set_requires(
            make_batch(1, name=f"h100-{n}"), {"gpu": "h100"}, now=T0
        )
    served = [make_batch(queued, name=f"a100-{n}") for n in range(2)]
    # Planned for these tables, as they are now.
    analyze("batches_batch", "batches_batchitem", "jobs_job", "jobs_lease", replan=True)
    for _ in range(3):  # prepared, and planned the one time it will be
        assert transitions.claim_next(worker, labels=LABELS, now=T0) is not None

    before = rows_read("batches_batch")
    job = transitions.claim_next(worker, labels=LABELS, now=T0)
    assert job is not None and job.batch_id in {batch.pk for batch in served}
    return rows_read("batches_batch") - before


@pytest.mark.parametrize("queued", [20, 300])
def test_a_claim_reads_the_batches_a_few_times_however_many_jobs_wait(worker, queued):
    """The claim's plan is generic, made for the average batch: among a
    hundred batches of one job each the average is about one queued job, and
    with its batch joined to the jobs it picks from the plan read the
    batches table once for every queued job of the batch it claimed from
    (2,125 rows for a claim among 102 batches, 19 of its jobs queued). The
    batch is read once now, however many of its jobs wait: a few walks of
    the open batches (the first two in claim order, the next free share),
    each at most the table."""
    assert batches_read_by_a_charged_claim(worker, ahead=100, queued=queued) <= 5 * 102


def test_a_charged_claim_walks_the_batches_ahead_of_its_own_once(worker):
    """A claim among batches of one priority walks the open batches in share
    order to the first it can serve, past every one it cannot (here 300 that
    require a GPU the worker lacks, always ahead: nobody claims from them).
    Charged to its batch's share, it then looks for the first batch no other
    claim holds (``statements.FIRST_BATCH``): that second look starts at the
    head, where the first stopped. Walking from the start again it read the
    300 twice per claim (605 rows). Three hundred batches are enough for the
    plan to walk the batches in claim order whatever earlier tests left in
    the tables (with a few dozen, it may scan them whole instead)."""
    ahead = 300
    read = batches_read_by_a_charged_claim(worker, ahead=ahead, queued=20)
    # The 300 once, and a few rows of the two served batches (found, locked,
    # charged): 305.
    assert ahead <= read < ahead + 15


def index_entries_read(index: str) -> int:
    """Entries of ``index`` this transaction's scans have returned (of live rows
    and of rows no longer visible alike; an index-only scan's too)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_get_xact_tuples_returned(%s::regclass)", [index])
        return cursor.fetchone()[0]


# The index of open ledger rows (one per live lease).
OPEN_LEDGER_ROWS = "lease_one_open_per_job"


def fleet(worker, other_worker, *, quiet_statistics=False) -> None:
    """A batch half done by ``worker`` and 200 live leases of
    ``other_worker`` (the rest of a fleet), the tables analyzed and this
    session's statements to be planned again. With ``quiet_statistics`` the
    ledger was last analyzed before the fleet claimed, when no lease was
    live (as after a quiet night)."""
    make_batch(2_000, name="fleet")
    finish(worker, 1_000)
    if quiet_statistics:
        analyze("jobs_lease")
    for _ in range(200):
        assert transitions.claim_next(other_worker, now=T0, max_leases=1_000)
    now_live = () if quiet_statistics else ("jobs_lease",)
    analyze("jobs_job", "batches_batchitem", *now_live, replan=True)


@pytest.mark.parametrize("many", [False, True], ids=["one", "many"])
def test_a_claim_looks_up_the_ledger_rows_of_its_own_jobs_only(
    worker, other_worker, many
):
    """A claim checks that no ledger row of an earlier lease was left open on
    each job it picks (``stray_lease``). Written as EXISTS, the generic plan
    hashed the whole open-row index instead of looking up the picked job's:
    each claim read an entry per live lease of the whole fleet (the 200 of
    another worker here; 2,000 for 250 GPU boxes of 8 leases), and one per
    ledger row closed since the table was last vacuumed: 1,203 entries for
    a claim of one job here, 1,224 for a claim of eight."""
    fleet(worker, other_worker)
    for _ in range(3):  # prepared, and planned the one time it will be
        assert claim(worker, None, many)

    leased = 8 if many else 1
    before = index_entries_read(OPEN_LEDGER_ROWS)
    assert claim(worker, None, many) == leased
    # One lookup per job picked, none of which has an open row: nothing read.
    assert index_entries_read(OPEN_LEDGER_ROWS) - before == 0


@pytest.mark.parametrize("call", ["heartbeat", "heartbeat_many", "complete_many"])
def test_a_heartbeat_or_completion_reads_the_ledger_rows_of_its_own_leases_only(
    worker, other_worker, call
):
    """A heartbeat extends its lease's open ledger row, a completion closes
    it. Found by token alone, the generic plan could walk every open row of
    the fleet and keep the one with that token, on every call (here 208, 208
    and 202 ledger rows read by one call): each now names its jobs' ids,
    which the index of open rows is keyed on, or looks the token up on its
    own index. The ledger's statistics are from before the fleet claimed, no
    lease live (with statistics of its 200 open rows the plan looked the
    token up even before)."""
    fleet(worker, other_worker, quiet_statistics=True)
    mine = transitions.claim_many(worker, max_jobs=8, now=T0)
    leases = [(job.pk, job.lease_token) for job in mine]

    def once() -> None:
        if call == "heartbeat":
            transitions.heartbeat(mine[0], mine[0].lease_token, worker=worker, now=T0)
        elif call == "heartbeat_many":
            transitions.heartbeat_many(leases, worker=worker, now=T0)
        else:
            transitions.complete_many(
                [(pk, token, {"text": "ok"}) for pk, token in leases[:1]],
                worker=worker,
                now=T0,
            )
            leases.pop(0)

    for _ in range(3):  # prepared, and planned the one time it will be
        once()
    before = rows_read("jobs_lease")
    once()
    # Its own ledger rows (one, or the eight), not the fleet's 200.
    assert rows_read("jobs_lease") - before <= len(mine)


@pytest.mark.parametrize("many", [False, True], ids=["one", "many"])
def test_a_claim_walks_past_the_jobs_claimed_before_it_once(worker, many):
    """Until the claim index is vacuumed, it holds an entry for every job
    claimed since, ahead of the queued ones; while some snapshot may still
    see those jobs queued (here: this test's own transaction, which claimed
    them), a walk reads each. The claim's probe of its batch walked past them,
    and then its pick walked past them all again."""
    make_batch(400, name="big")
    finish(worker, 200)
    analyze("jobs_job", "batches_batch")
    before = index_entries_read("job_claim")
    assert claim(worker, None, many) == (8 if many else 1)
    read = index_entries_read("job_claim") - before
    # The probe walks past the 200 (and stops at the first queued job); the
    # pick starts there.
    assert 200 <= read < 230


@pytest.mark.parametrize("call", ["heartbeat", "complete"])
def test_a_heartbeat_or_completion_reads_its_own_job_only(worker, call):
    """A heartbeat and a completion name their job by its id. With the jobs
    table last analyzed before any lease was live, the generic plan took
    ``leased_by_id = %(worker)s`` for an index walk of all the worker's
    leases and kept the one with that id: 200 and 198 job rows read by one
    call here, where the worker holds 200 leases (its cap raised). Kept from
    that index alone, ``status = 'leased'`` led it to walk every leased job
    of the fleet instead."""
    make_batch(400, name="many-gpus")
    analyze("jobs_job")
    mine = [
        transitions.claim_next(worker, now=T0, max_leases=1_000) for _ in range(200)
    ]
    analyze("batches_batchitem", "jobs_lease", replan=True)

    def once(job) -> None:
        if call == "heartbeat":
            transitions.heartbeat(job, job.lease_token, worker=worker, now=T0)
        else:
            transitions.complete(
                job, job.lease_token, worker=worker, result={"text": "ok"}, now=T0
            )

    for job in mine[:3]:  # prepared, and planned the one time it will be
        once(job)
    before = rows_read("jobs_job")
    once(mine[100])
    # The job, found by its id (and, for a completion, its row again to write).
    assert rows_read("jobs_job") - before <= 2
