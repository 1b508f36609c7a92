from datetime import timedelta

import pytest

from api.worker_views import claimed
from batches.models import Batch, BatchItem, ItemStatus
from engine.sweep import sweep
from jobs import transitions
from jobs.exceptions import TooManyLeases, WorkerDisabled
from jobs.models import Event, Job, JobStatus, Lease, LeaseEnd, Worker
from tests.support.factories import (
    T0,
    assert_consistent,
    claim,
    jobs_of,
    later,
    make_batch,
    snapshot,
)

pytestmark = pytest.mark.django_db


def test_claim_leases_the_oldest_job_and_moves_item_and_ledger(worker, batch):
    first = jobs_of(batch)[0]

    job = claim(worker)

    assert job.pk == first.pk
    job.refresh_from_db()
    assert job.status == JobStatus.LEASED
    assert job.leased_by == worker
    assert job.attempts == 1
    assert job.lease_expires_at == T0 + timedelta(seconds=60)
    assert job.heartbeat_at == T0
    assert len(job.lease_token) >= 32
    assert BatchItem.objects.get(pk=job.item_id).status == ItemStatus.TRANSCRIBING
    lease = Lease.objects.get(job=job)
    assert (lease.worker, lease.token, lease.attempt) == (worker, job.lease_token, 1)
    assert (lease.claimed_at, lease.ended_at, lease.end_reason) == (T0, None, None)
    assert batch.counts()["queued"] == 2
    assert batch.counts()["transcribing"] == 1
    assert_consistent()


def test_each_claim_gets_a_different_job_with_a_fresh_token(worker, batch):
    jobs = [claim(worker) for _ in range(3)]

    assert [j.pk for j in jobs] == [j.pk for j in jobs_of(batch)]
    assert len({j.lease_token for j in jobs}) == 3
    assert transitions.claim_next(worker, now=T0) is None


def test_nothing_to_claim_returns_none(worker, db):
    assert transitions.claim_next(worker, now=T0) is None


def test_higher_priority_batch_first_then_older_batch(worker, db):
    old = make_batch(1, name="old")
    new = make_batch(1, name="new")
    urgent = make_batch(1, name="urgent", priority=5)

    order = [claim(worker).batch_id for _ in range(3)]

    assert order == [urgent.pk, old.pk, new.pk]


def test_paused_batch_is_skipped_until_resumed(worker, db):
    paused = make_batch(2, name="paused")
    other = make_batch(1, name="other")
    transitions.pause_batch(paused, now=T0)

    assert claim(worker).batch_id == other.pk
    assert transitions.claim_next(worker, now=T0) is None

    transitions.resume_batch(paused)
    assert claim(worker).batch_id == paused.pk


def test_cancelled_batch_is_never_claimed(worker, db):
    batch = make_batch(2)
    transitions.cancel_batch(batch, now=T0)

    assert transitions.claim_next(worker, now=T0) is None
    assert batch.counts()["cancelled"] == 2


def test_job_in_backoff_waits_until_available(worker, batch, settings):
    settings.RECALL_LEASE_SECONDS = 1000
    job = jobs_of(batch)[0]
    Job.objects.filter(pk=job.pk).update(available_at=later(100))

    assert [claim(worker).pk for _ in range(2)] == [j.pk for j in jobs_of(batch)[1:]]
    assert transitions.claim_next(worker, now=later(99)) is None
    assert transitions.claim_next(worker, now=later(100)).pk == job.pk


def test_claim_reclaims_expired_leases_first(worker, other_worker, db):
    batch = make_batch(1)
    stale = claim(worker)

    # Before expiry nothing is claimable; after it, the claim reclaims first.
    assert transitions.claim_next(other_worker, now=later(60)) is None
    again = claim(other_worker, now=later(61))

    assert again.pk == stale.pk
    assert again.attempts == 2
    assert again.leased_by == other_worker
    leases = list(Lease.objects.filter(job=again).order_by("pk"))
    assert [(lease.worker, lease.end_reason) for lease in leases] == [
        (worker, LeaseEnd.EXPIRED),
        (other_worker, None),
    ]
    assert leases[0].ended_at == later(61)
    assert batch.counts()["transcribing"] == 1
    assert_consistent(later(61))


def test_finished_batch_is_not_looked_at(worker, db):
    batch = make_batch(1)
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=T0
    )
    # The completion finished the batch itself (issue 13: in its transaction,
    # with its batch.finished event); the sweep's settle finds nothing to do.
    assert Batch.objects.get(pk=batch.pk).finished_at == T0
    assert transitions.settle(now=T0) == 0

    assert Batch.objects.open().filter(pk=batch.pk).exists() is False
    assert transitions.claim_next(worker, now=T0) is None


def test_claim_heals_a_drifted_item_it_touches(worker, batch):
    first = jobs_of(batch)[0]
    # Drift behind Recall's back: the item says done, its job is queued.
    BatchItem.objects.filter(pk=first.item_id).update(status=ItemStatus.DONE)

    job = claim(worker)

    assert job.pk == first.pk
    assert BatchItem.objects.get(pk=job.item_id).status == ItemStatus.TRANSCRIBING
    repair = Event.objects.repairs().get(job=job)
    assert (
        repair.message == "Item was done while its job was queued; set to transcribing."
    )
    # The raw edit bypassed the counters: the repair asks the sweep to recount.
    batch.refresh_from_db()
    assert batch.recount_requested_at == T0
    sweep(now=T0)
    assert batch.counts()["queued"] == 2
    assert batch.counts()["transcribing"] == 1
    assert batch.counts()["done"] == 0
    batch.refresh_from_db()
    assert batch.recount_requested_at is None
    assert_consistent()


def test_claim_closes_a_stray_open_ledger_row_and_succeeds(worker, batch):
    first = jobs_of(batch)[0]
    Lease.objects.create(
        job=first, worker=worker, token="stray", attempt=1, claimed_at=T0
    )

    job = claim(worker, now=later(1))

    assert job.pk == first.pk
    stray = Lease.objects.get(token="stray")
    assert (stray.end_reason, stray.ended_at) == (LeaseEnd.EXPIRED, later(1))
    assert Lease.objects.get(job=job, ended_at__isnull=True).token == job.lease_token
    assert Event.objects.repairs().filter(job=job).count() == 1


def test_job_with_no_attempts_left_is_not_claimed(worker, batch):
    first = jobs_of(batch)[0]
    Job.objects.filter(pk=first.pk).update(attempts=3)

    claimed = [claim(worker).pk for _ in range(2)]

    assert first.pk not in claimed
    assert transitions.claim_next(worker, now=T0) is None


@pytest.mark.django_db(transaction=True)
def test_a_claim_on_a_connection_the_database_dropped_reconnects(worker, batch):
    """A database restart leaves each thread's persistent connection dead. The
    first statement of the next request health-checks it and reconnects, for
    the statements the transition layer runs on the driver directly too."""
    from django.db import connection, connections

    if connection.vendor != "postgresql":
        pytest.skip("only a server can drop a connection")
    connection.ensure_connection()
    dropped = connection.connection.info.backend_pid
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            # Wait (up to 5 s) until it is gone, as a restart leaves it.
            cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [dropped])
    finally:
        other.close()
    connection.health_check_done = False  # as at the start of each request

    job = claim(worker)

    assert job.pk == jobs_of(batch)[0].pk
    assert connection.connection.info.backend_pid != dropped
    assert_consistent()


# --- The worker's lease cap, enforced by the claim itself ---------------------------


def test_a_claim_at_the_workers_lease_cap_is_refused_and_writes_nothing(
    worker, batch, settings
):
    settings.RECALL_MAX_LEASES_PER_WORKER = 2
    held = [claim(worker), claim(worker)]
    before = snapshot(*jobs_of(batch))

    with pytest.raises(
        TooManyLeases,
        match=r"^Worker 'gpu-1' already holds 2 live leases \(the limit is 2\): "
        r"finish, fail or release one before claiming more\.$",
    ) as refused:
        transitions.claim_next(worker, now=later(1))

    assert (refused.value.held, refused.value.limit) == (2, 2)
    assert snapshot(*jobs_of(batch)) == before
    # Ending a lease makes room; a lower cap given to the claim refuses again.
    transitions.complete(
        held[0], held[0].lease_token, worker=worker, result={"text": "t"}, now=T0
    )
    assert transitions.claim_next(worker, now=later(2)).pk == jobs_of(batch)[2].pk
    make_batch(1, name="more")
    with pytest.raises(TooManyLeases):
        transitions.claim_next(worker, now=later(3), max_leases=1)
    assert_consistent(later(3))


def test_a_worker_at_its_cap_with_nothing_claimable_gets_nothing(worker, settings):
    """Nothing to lease is nothing to refuse: the same answer as for any
    claim that finds no work."""
    settings.RECALL_MAX_LEASES_PER_WORKER = 1
    make_batch(1)
    claim(worker)

    assert transitions.claim_next(worker, now=later(1)) is None


@pytest.mark.django_db(transaction=True)
def test_a_claim_after_a_dropped_connection_gets_a_cursor_of_the_new_one(worker, batch):
    """The statement backend keeps one cursor per connection: after a claim on a
    connection the database then dropped, the next claim uses the new one."""
    from django.db import connection, connections

    if connection.vendor != "postgresql":
        pytest.skip("only a server can drop a connection")
    first = claim(worker)
    dropped = connection.connection.info.backend_pid
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [dropped])
    finally:
        other.close()
    connection.health_check_done = False  # as at the start of each request

    second = claim(worker)

    assert [first.pk, second.pk] == [j.pk for j in jobs_of(batch)[:2]]
    assert connection.connection.info.backend_pid != dropped
    assert_consistent()


def test_a_claimed_job_carries_the_times_the_orm_reads(worker, batch):
    """The claim's job, built from the statement's row (the statement backend
    reads timestamps with psycopg's own loader), has the very datetimes the
    ORM reads back: same instants, same zone object."""
    job = transitions.claim_next(worker)  # the database's clock, as the API
    stored = Job.objects.get(pk=job.pk)

    for name in ("lease_expires_at", "heartbeat_at", "updated_at", "created_at"):
        mine, orms = getattr(job, name), getattr(stored, name)
        assert (mine, mine.tzinfo) == (orms, orms.tzinfo), name
    assert (job.item.created_at, job.item.created_at.tzinfo) == (
        stored.item.created_at,
        stored.item.created_at.tzinfo,
    )


# The job's fields a claim writes (the others it leaves as they were).
CLAIM_WRITES_JOB = {
    "status",
    "lease_token",
    "leased_by_id",
    "lease_expires_at",
    "heartbeat_at",
    "attempts",
    "updated_at",
}


def test_a_claimed_job_reads_every_field_as_stored_and_answers_without_a_query(
    worker, batch, django_assert_num_queries
):
    """The statement backend returns only the fields the claim checks and the
    worker is handed (``statements.CLAIMED_JOB_FIELDS``): the claim's answer
    needs no query more, and every field the claim does not write reads as
    stored (from the database, if asked for)."""
    first = jobs_of(batch)[0]
    Job.objects.filter(pk=first.pk).update(
        last_error="gpu fell off the bus", requires={"gpu": "a100"}
    )

    job = transitions.claim_next(worker, labels={"gpu": "a100"})

    with django_assert_num_queries(0):
        answer = claimed(job)
    assert answer["job"]["item"]["source"] == job.item.source
    assert answer["job"]["batch"] == {"id": batch.pk, "name": batch.name}
    stored = Job.objects.select_related("item").get(pk=job.pk)
    for model, mine, theirs, written in (
        (Job, job, stored, CLAIM_WRITES_JOB),
        (BatchItem, job.item, stored.item, {"status", "updated_at"}),
    ):
        for field in model._meta.concrete_fields:
            if field.attname not in written:
                assert getattr(mine, field.attname) == getattr(theirs, field.attname), (
                    model.__name__,
                    field.attname,
                )
    assert (job.last_error, job.requires) == ("gpu fell off the bus", {"gpu": "a100"})


def test_a_claim_by_a_worker_disabled_after_authentication_leases_nothing(
    worker, batch
):
    """The request was authenticated while the worker was active, then an
    operator disabled it (``disable_and_reclaim`` committed) before the claim
    took its turn: the claim sees the disable under the worker's lock and
    leases nothing, in both backends."""
    authenticated = Worker.objects.get(pk=worker.pk)  # is_active, as it was read
    held = claim(worker)
    transitions.disable_and_reclaim(worker, now=later(1))
    before = snapshot(*jobs_of(batch))

    with pytest.raises(WorkerDisabled, match=r"^Worker 'gpu-1' is disabled\.$"):
        transitions.claim_next(authenticated, now=later(2))

    assert snapshot(*jobs_of(batch)) == before
    assert not Job.objects.filter(leased_by=worker).exists()
    assert Lease.objects.get(job_id=held.pk).end_reason == LeaseEnd.FORCED
    assert_consistent(later(2))
