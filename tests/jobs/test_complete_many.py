"""The batched completion (``transitions.complete_many``): many results of one
worker made in one call, each judged exactly as the single completion judges
it (replays included), quality flags, counters, throughput, the batch's finish
and its outbox exactly as after as many single completions."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, transaction

from batches.models import BatchCounter, BatchItem, BatchMinute
from jobs import transitions
from jobs.exceptions import LeaseLost
from jobs.models import Job, JobStatus, Lease, LeaseEnd, WebhookDelivery
from jobs.transitions.rules import COMPLETED, LEASE_LOST, NOT_FOUND
from tests.support.factories import (
    assert_consistent,
    claim,
    failpoint,
    finished_events,
    later,
    make_batch,
    make_endpoint,
    make_worker,
    snapshot,
)
from tests.support.threads import run_threads

BACKENDS = ["auto", "orm"]  # on SQLite both are the ORM backend

# Items whose results come out flagged in every way (batches.flags), and not.
DURATIONS = [10, 60, 5, 60, 60, None]
LANGUAGES = ["en", "en", "en", "", "en", "en"]
RESULTS = [
    {"text": ""},
    {"text": "only a few words here"},
    {"text": "hallo welt", "language": "de"},
    {"text": " ".join(["w"] * 25), "language": "de"},
    {"text": "", "language": "fr"},
    {
        "text": "hi",
        "language": "en",
        "segments": [{"start": 0, "end": 1, "text": "hi"}],
    },
]


def _rows(*jobs: Job) -> dict:
    """The jobs, their items and ledger rows (``snapshot`` less the batch-wide
    rows, which the other completions of a call move)."""
    return {
        k: v for k, v in snapshot(*jobs).items() if k in ("jobs", "items", "leases")
    }


def _state(batch) -> dict:
    """What completions leave in a batch, without its ids and instants."""
    items = BatchItem.objects.filter(batch=batch).order_by("pk")
    jobs = Job.objects.filter(batch=batch).order_by("pk")
    minutes = BatchMinute.objects.filter(batch=batch)
    return {
        "items": [(i.status, i.flags) for i in items],
        "jobs": [(j.status, j.result, j.attempts, j.leased_by_id) for j in jobs],
        "counters": BatchCounter.objects.filter(batch=batch).totals(),
        "done": sum(m.done for m in minutes),
        "done_ms": sum(m.done_ms for m in minutes),
        "ledger": sorted(
            Lease.objects.filter(job__batch=batch).values_list("end_reason", flat=True)
        ),
        "finished": batch.__class__.objects.get(pk=batch.pk).finished_at is not None,
        "events": len(finished_events(batch)),
    }


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", [0, 2])  # the batch finishes by them, or not
def test_one_call_leaves_what_as_many_single_completions_leave(
    settings, backend, extra
):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    worker = make_worker()
    make_endpoint()
    states = []
    for together in (False, True):
        batch = make_batch(
            durations=DURATIONS + [60] * extra,
            languages=LANGUAGES + ["en"] * extra,
            name=f"together-{together}",
        )
        jobs = [claim(worker, now=later(1)) for _ in RESULTS]
        assert {job.batch_id for job in jobs} == {batch.pk}
        asked = [(j.pk, j.lease_token, r) for j, r in zip(jobs, RESULTS, strict=True)]
        if together:
            answers = transitions.complete_many(asked, worker=worker, now=later(5))
            assert answers == [COMPLETED] * len(RESULTS)
        else:
            for job_id, token, result in asked:
                transitions.complete(
                    job_id, token, worker=worker, result=result, now=later(5)
                )
        states.append(_state(batch))
        transitions.pause_batch(batch)  # the next claims are the next batch's

    alone, together = states
    assert together == alone
    assert [flags for _, flags in together["items"][: len(RESULTS)]] == [
        ["empty"],
        ["short"],
        ["language_mismatch"],
        [],
        ["empty", "language_mismatch", "short"],
        [],
    ]
    assert together["finished"] is (extra == 0)
    assert together["events"] == (1 if extra == 0 else 0)
    assert WebhookDelivery.objects.count() == (2 if extra == 0 else 0)
    assert_consistent(later(5))


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_completed_replayed_lost_and_unknown_answer_in_request_order(
    settings, backend, worker, other_worker
):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    make_batch(8)
    mine, replayed, wrong, released, expired = (claim(worker) for _ in range(5))
    theirs = claim(other_worker)
    transitions.complete(
        replayed, replayed.lease_token, worker=worker, result={"text": "first"},
        now=later(1),
    )  # fmt: skip
    transitions.release(released, released.lease_token, worker=worker, now=later(1))
    untouched = _rows(wrong, released, theirs, replayed)

    answers = transitions.complete_many(
        [
            (999_999, "no-such-job", {"text": "x"}),
            (mine.pk, mine.lease_token, {"text": "mine"}),
            (theirs.pk, theirs.lease_token, {"text": "x"}),  # another worker's
            (wrong.pk, "not-the-token", {"text": "x"}),
            (replayed.pk, replayed.lease_token, {"text": "again"}),  # a replay
            (released.pk, released.lease_token, {"text": "x"}),  # the lease ended
            (expired.pk, expired.lease_token, {"text": "late"}),  # not reclaimed yet
            (0, "t", {"text": "x"}),
            (2**63, "t", {"text": "x"}),  # larger than any id a column holds
        ],
        worker=worker,
        now=later(500),
    )

    assert answers == [
        NOT_FOUND,
        COMPLETED,
        LEASE_LOST,
        LEASE_LOST,
        COMPLETED,
        LEASE_LOST,
        COMPLETED,
        NOT_FOUND,
        NOT_FOUND,
    ]
    for job, text in ((mine, "mine"), (expired, "late")):
        job.refresh_from_db()
        assert (job.status, job.result["text"]) == (JobStatus.COMPLETED, text)
    # The replay changed nothing (the first result stays), nor did the others.
    assert _rows(wrong, released, theirs, replayed) == untouched
    assert_consistent(later(50))  # (the leases left live expire at 60 s)


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_entry_is_judged_as_the_single_completion_judges_it(
    settings, backend, worker, other_worker
):
    """Every kind of entry asked alone (on one copy of the rows) and together
    (on another): the same answers, the single one's errors mapped to codes."""
    settings.RECALL_TRANSITIONS_BACKEND = backend

    def world(name):
        batch = make_batch(6, name=name)
        jobs = [claim(worker) for _ in range(4)] + [claim(other_worker)]
        transitions.complete(
            jobs[1], jobs[1].lease_token, worker=worker, result={"text": "a"},
            now=later(1),
        )  # fmt: skip
        transitions.release(jobs[2], jobs[2].lease_token, worker=worker, now=later(1))
        transitions.pause_batch(batch)  # the next world's claims are its own
        return [(job.pk, job.lease_token, {"text": "b"}) for job in jobs] + [
            (jobs[0].pk + 1000, "x", {"text": "b"})
        ]

    alone = []
    for job_id, token, result in world("alone"):
        try:
            transitions.complete(
                job_id, token, worker=worker, result=result, now=later(9)
            )
            alone.append(COMPLETED)
        except LeaseLost:
            exists = Job.objects.filter(pk=job_id).exists()
            alone.append(LEASE_LOST if exists else NOT_FOUND)
    together = transitions.complete_many(world("together"), worker=worker, now=later(9))

    assert (
        together
        == alone
        == [COMPLETED, COMPLETED, LEASE_LOST, COMPLETED, LEASE_LOST, NOT_FOUND]
    )


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_replaying_the_whole_call_changes_nothing(settings, backend, worker):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(3)
    make_endpoint()
    jobs = [claim(worker) for _ in range(3)]
    asked = [(j.pk, j.lease_token, {"text": f"t{n}"}) for n, j in enumerate(jobs)]
    assert (
        transitions.complete_many(asked, worker=worker, now=later(5)) == [COMPLETED] * 3
    )
    after = snapshot(*jobs)
    deliveries = WebhookDelivery.objects.count()

    again = [(job_id, token, {"text": "other"}) for job_id, token, _ in asked]
    assert (
        transitions.complete_many(again, worker=worker, now=later(9)) == [COMPLETED] * 3
    )

    assert snapshot(*jobs) == after
    assert len(finished_events(batch)) == 1
    assert WebhookDelivery.objects.count() == deliveries == 1
    assert_consistent(later(9))


def test_an_empty_call_asks_nothing(worker):
    assert transitions.complete_many([], worker=worker, now=later(1)) == []


def test_job_ids_must_be_distinct(worker, batch):
    job = claim(worker)
    with pytest.raises(ValueError, match="at most once"):
        transitions.complete_many(
            [(job.pk, job.lease_token, {"text": "a"})] * 2, worker=worker, now=later(1)
        )


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_completes_all_or_nothing(settings, backend, worker):
    """One transaction (one statement on PostgreSQL): when closing one ledger
    row fails, no job, item or counter moved."""
    settings.RECALL_TRANSITIONS_BACKEND = backend
    make_batch(5)
    jobs = [claim(worker) for _ in range(3)]
    before = snapshot(*jobs)

    with (
        failpoint(Lease._meta.db_table),
        pytest.raises(DatabaseError, match="failpoint"),
        transaction.atomic(),
    ):
        transitions.complete_many(
            [(j.pk, j.lease_token, {"text": "x"}) for j in jobs],
            worker=worker,
            now=later(9),
        )

    assert snapshot(*jobs) == before


# --- Concurrency (real threads, real transactions) --------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_call_sent_twice_at_once_completes_each_job_once(settings, backend):
    """Two copies of one batched completion (a worker that retried before the
    first answer came) and a single completion of one of its jobs, all at
    once: every answer is completed, each job is completed exactly once, and
    the counters, minutes and ledger say so."""
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(12)
    worker = make_worker()
    jobs = [claim(worker) for _ in range(8)]
    asked = [(j.pk, j.lease_token, {"text": f"r{j.pk}"}) for j in jobs]

    def complete(i, barrier):
        barrier.wait()
        if i == 2:
            transitions.complete(
                jobs[3].pk, jobs[3].lease_token, worker=worker,
                result={"text": f"r{jobs[3].pk}"},
            )  # fmt: skip
            return [COMPLETED]
        return transitions.complete_many(asked, worker=worker)

    outcomes = run_threads(complete, 3)

    assert outcomes[0] == outcomes[1] == [COMPLETED] * 8
    assert Job.objects.filter(batch=batch, status=JobStatus.COMPLETED).count() == 8
    assert (
        Lease.objects.filter(end_reason=LeaseEnd.COMPLETED, ended_at__isnull=False)
        .values("job_id")
        .distinct()
        .count()
        == Lease.objects.count()
        == 8
    )
    totals = BatchCounter.objects.filter(batch=batch).totals()
    assert (totals["done"], totals["transcribing"], totals["queued"]) == (8, 0, 4)
    assert (
        sum(BatchMinute.objects.filter(batch=batch).values_list("done", flat=True)) == 8
    )
    assert_consistent(later(1))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_completing_across_shards_at_once_never_deadlock(settings, backend):
    """Four workers, each holding jobs spread over every counter shard of two
    batches, complete them in batched calls at once, round after round: the
    counters are taken in one order (batch, shard), so no call deadlocks, and
    the batches finish exactly once each."""
    settings.RECALL_TRANSITIONS_BACKEND = backend
    settings.RECALL_MAX_LEASES_PER_WORKER = 64
    first, second = make_batch(48, name="first"), make_batch(48, name="second")
    workers = [make_worker(f"gpu-{n}") for n in range(4)]
    make_endpoint()
    held = {w.pk: [] for w in workers}
    for n in range(96):
        worker = workers[n % 4]
        job = claim(worker)
        held[worker.pk].append((job.pk, job.lease_token, {"text": f"{job.pk}"}))

    def complete(i, barrier):
        mine = held[workers[i].pk]
        answers = []
        for round_ in range(3):
            chunk = mine[round_ * 8 : round_ * 8 + 8]
            barrier.wait()
            answers += transitions.complete_many(chunk[::-1], worker=workers[i])
        return answers

    outcomes = run_threads(complete, 4)

    assert all(o == [COMPLETED] * 24 for o in outcomes)
    for batch in (first, second):
        totals = BatchCounter.objects.filter(batch=batch).totals()
        assert (totals["done"], totals["transcribing"]) == (48, 0)
        assert len(finished_events(batch)) == 1
    assert Job.objects.filter(status=JobStatus.COMPLETED).count() == 96
    assert_consistent(later(1))
