"""Re-run (issue 29): done and failed items sent back to the queue as a new run.

The transition keeps each job's run so far (``JobRun``), queues the job with
fresh attempts and, optionally, a requirement of its own that the claim checks
on both backends (the statement backend in SQL, the ORM backend through
``RequiresMet``); the counters, flag counts and the batch's finish follow, and
its undo paths (reclaim, release, cancel) keep or clear exactly what it wrote.
Transition cases run on both backends on PostgreSQL and on the ORM backend on
SQLite.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError

from batches.flags import UnknownFlag
from batches.labels import LabelError
from batches.models import Batch, BatchItem, ItemStatus
from engine.longpoll import claimable_work, combined
from jobs import transitions
from jobs.exceptions import BatchClosed, RerunRefused
from jobs.models import Event, Job, JobRun, JobStatus, Lease, Tally
from jobs.transitions.rules import lease_duration
from tests.support.factories import (
    T0,
    assert_consistent,
    failpoint,
    finished_events,
    item_ids,
    jobs_of,
    later,
    make_batch,
    make_endpoint,
    make_user,
    make_worker,
    snapshot,
)

pytestmark = pytest.mark.django_db

BACKENDS = ["auto", "orm"]  # on SQLite both are the ORM backend
LARGE = {"model": "large-v3"}


def finish_all(batch: Batch, worker, *, texts=None, fail_last=False, now=T0):
    """Claim and end every job of ``batch``: complete with ``texts`` (one per
    job, default "hello"), the last failed for good if ``fail_last``."""
    jobs = jobs_of(batch)
    for i, _ in enumerate(jobs):
        job = transitions.claim_next(worker, now=now)
        assert job is not None and job.batch_id == batch.pk
        if fail_last and i == len(jobs) - 1:
            transitions.fail(
                job,
                job.lease_token,
                worker=worker,
                error="boom",
                retryable=False,
                now=now,
            )
        else:
            text = texts[i] if texts else "hello"
            transitions.complete(
                job, job.lease_token, worker=worker, result={"text": text}, now=now
            )


def counts(batch: Batch) -> dict[str, int]:
    return {k: v for k, v in batch.counts().items() if not k.endswith("_ms")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rerun_queues_done_and_failed_items_as_a_new_run(settings, backend):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    endpoint = make_endpoint()
    operator = make_user("ops")
    # 60 s of audio: "hello" is one word a minute, so "short"; "" is "empty".
    batch = make_batch(durations=[60.0, 60.0, 60.0], name="calls")
    worker = make_worker("gpu-1")
    finish_all(batch, worker, texts=["", "hello", "x"], fail_last=True)
    batch.refresh_from_db()
    assert batch.finished_at is not None and batch.finishes == 1
    first, _, third = item_ids(batch)
    before = counts(batch)
    assert before["done"] == 2 and before["failed"] == 1
    assert (before["flag_empty"], before["flag_short"]) == (1, 2)

    n = transitions.rerun(
        batch, items=[first, third], requires=LARGE, actor=operator, now=later(10)
    )

    assert n == 2
    batch.refresh_from_db()
    assert batch.finished_at is None  # running again
    after = counts(batch)
    assert (after["queued"], after["done"], after["failed"]) == (2, 1, 0)
    # The empty (and short) item's flags left it, and its flag counts with them.
    assert (after["flag_empty"], after["flag_short"]) == (0, 1)
    assert BatchItem.objects.get(pk=first).flags == []
    job = Job.objects.get(item_id=first)
    assert (job.status, job.attempts, job.result, job.run) == ("queued", 0, None, 2)
    assert (job.requires, job.available_at, job.finished_at) == (LARGE, later(10), None)
    failed = Job.objects.get(item_id=third)
    assert (failed.status, failed.last_error, failed.run) == ("queued", "", 2)
    runs = {r.job.item_id: r for r in JobRun.objects.select_related("job")}
    assert set(runs) == {first, third}
    kept = runs[first]
    assert (kept.number, kept.status, kept.result) == (1, "completed", {"text": ""})
    assert (kept.flags, kept.attempts, kept.requires) == (["empty", "short"], 1, {})
    assert (kept.worker, kept.rerun_by, kept.rerun_at) == (worker, operator, later(10))
    assert kept.last_lease_id == Lease.objects.get(job__item_id=first).pk
    assert (runs[third].status, runs[third].error) == ("failed", "boom")
    event = Event.objects.get(kind=Event.Kind.RERUN)
    assert (event.batch_id, event.actor, event.created_at) == (
        batch.pk,
        operator,
        later(10),
    )
    assert event.message == (
        "Re-ran 2 items, requiring model=large-v3 (the batch is running again)."
    )
    tallies = dict(Tally.objects.values_list("name", "count"))
    assert tallies["jobs_completed_rerun"] == 1
    assert tallies["jobs_failed_retried"] == 1
    assert_consistent(later(10))

    # The new run: only a worker offering the requirement takes the jobs; its
    # first lease is attempt 1 again, and the batch finishes a second time.
    big = make_worker("big")
    assert transitions.claim_next(worker, now=later(20)) is None
    for _ in range(2):
        job = transitions.claim_next(big, labels=LARGE, now=later(20))
        assert job is not None and job.attempts == 1
        transitions.complete(
            job,
            job.lease_token,
            worker=big,
            result={"text": "many words " * 30},
            now=later(30),
        )
    batch.refresh_from_db()
    assert batch.finished_at == later(30) and batch.finishes == 2
    assert [e.generation for e in finished_events(batch)] == [1, 2]
    assert endpoint.deliveries.count() == 2
    final = counts(batch)
    assert (final["done"], final["queued"], final["flag_empty"]) == (3, 0, 0)
    assert final["flag_short"] == 1  # the second item, never re-run
    assert not transitions.recount(batch.pk, now=later(40))  # counters were right
    assert_consistent(later(40))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rerun_by_flag_takes_the_flagged_done_items_only(settings, backend):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(durations=[60.0, 60.0, 10.0, 60.0])
    worker = make_worker()
    finish_all(batch, worker, texts=["hi", "many words " * 30, "hi"], fail_last=True)
    short = list(
        BatchItem.objects.filter(batch=batch, flag_short=True).values_list(
            "pk", flat=True
        )
    )
    assert len(short) == 1  # the 10 s item is too short to be "short"

    assert transitions.rerun(batch, flag="short", now=later(5)) == 1

    assert (
        list(Job.objects.filter(status="queued").values_list("item_id", flat=True))
        == short
    )
    assert transitions.rerun(batch, flag="short", now=later(6)) == 0
    assert transitions.rerun(batch, flag="empty", now=later(6)) == 0
    assert Event.objects.filter(kind=Event.Kind.RERUN).count() == 1
    assert Event.objects.get(kind=Event.Kind.RERUN).message == (
        "Re-ran 1 item with flag short, with no requirement (the batch is running "
        "again)."
    )
    assert_consistent(later(6))


def test_only_done_and_failed_items_rerun_and_a_refusal_writes_nothing():
    batch = make_batch(3)
    worker = make_worker()
    done = transitions.claim_next(worker, now=T0)
    transitions.complete(done, done.lease_token, worker=worker, result={"text": "a"})
    leased = transitions.claim_next(worker, now=T0)
    other = make_batch(1, name="other")
    queued = Job.objects.get(batch=batch, status="queued")
    everything = snapshot(*jobs_of(batch))

    with pytest.raises(RerunRefused) as refused:
        transitions.rerun(batch, items=[done.item_id, leased.item_id, queued.item_id])
    assert refused.value.busy == {
        leased.item_id: ItemStatus.TRANSCRIBING,
        queued.item_id: ItemStatus.QUEUED,
    }
    assert "only done or failed items can be re-run" in str(refused.value)
    stranger = jobs_of(other)[0].item_id
    with pytest.raises(RerunRefused) as refused:
        transitions.rerun(batch, items=[done.item_id, stranger, 10**12])
    assert refused.value.missing == [stranger, 10**12]
    with pytest.raises(UnknownFlag):
        transitions.rerun(batch, flag="loud")
    with pytest.raises(LabelError):
        transitions.rerun(batch, items=[done.item_id], requires={"GPU": "x"})
    with pytest.raises(ValueError, match="either items or a flag"):
        transitions.rerun(batch, items=[done.item_id], flag="short")

    assert snapshot(*jobs_of(batch)) == everything
    assert not JobRun.objects.exists()
    assert not Event.objects.filter(kind=Event.Kind.RERUN).exists()


def test_a_cancelled_batch_and_a_clashing_requirement_are_refused():
    batch = make_batch(1)
    worker = make_worker()
    finish_all(batch, worker)
    Batch.objects.filter(pk=batch.pk).update(requires={"model": "small"})
    item = item_ids(batch)[0]
    with pytest.raises(LabelError, match="the batch requires model=small"):
        transitions.rerun(batch, items=[item], requires=LARGE)
    assert transitions.rerun(batch, items=[item], requires={"model": "small"}) == 1
    transitions.cancel_batch(batch, now=later(1))
    with pytest.raises(BatchClosed):
        transitions.rerun(batch, items=[item])


def test_a_rerun_that_fails_part_way_writes_nothing():
    batch = make_batch(2)
    worker = make_worker()
    finish_all(batch, worker)
    everything = snapshot(*jobs_of(batch))

    with failpoint("batches_batch"), pytest.raises(DatabaseError):
        transitions.rerun(batch, items=item_ids(batch), requires=LARGE, now=later(1))

    assert snapshot(*jobs_of(batch)) == everything
    assert not JobRun.objects.exists()
    assert not Tally.objects.filter(name="jobs_completed_rerun").exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_whose_only_work_needs_labels_hides_no_other_batch(settings, backend):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    first = make_batch(2, name="first", priority=9)
    worker = make_worker("plain")
    finish_all(first, worker)
    transitions.rerun(first, items=item_ids(first), requires=LARGE, now=later(1))
    second = make_batch(1, name="second", priority=0)

    # The higher-priority batch has claimable work, all of it needing
    # model=large-v3: a plain worker gets the other batch's job, not a 204.
    job = transitions.claim_next(worker, now=later(2))
    assert job is not None and job.batch_id == second.pk
    assert (
        transitions.claim_next(worker, labels={"model": "small"}, now=later(2)) is None
    )
    big = make_worker("big")
    taken = [
        transitions.claim_next(big, labels={**LARGE, "gpu": "a100"}, now=later(2))
        for _ in range(3)
    ]
    assert [j.batch_id if j else None for j in taken] == [first.pk, first.pk, None]
    assert_consistent(later(2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_claim_many_and_a_capped_batch_respect_the_rerun_requirement(settings, backend):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(3)
    worker = make_worker("plain")
    finish_all(batch, worker)
    Batch.objects.filter(pk=batch.pk).update(max_in_flight=2)  # the ORM's path
    first, second, third = item_ids(batch)
    transitions.rerun(batch, items=[first], requires=LARGE, now=later(1))
    transitions.rerun(batch, items=[second, third], now=later(1))

    plain = transitions.claim_many(worker, max_jobs=3, now=later(2))
    assert sorted(j.item_id for j in plain) == [second, third]
    big = make_worker("big")
    assert transitions.claim_many(big, labels=LARGE, max_jobs=3, now=later(2)) == []
    transitions.release(plain[0], plain[0].lease_token, worker=worker, now=later(3))
    taken = transitions.claim_many(big, labels=LARGE, max_jobs=3, now=later(3))
    assert [j.item_id for j in taken] == [first]
    assert_consistent(later(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reclaim_and_release_keep_the_rerun_requirement_cancel_clears_it(
    settings, backend
):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(3)
    worker = make_worker("plain")
    finish_all(batch, worker)
    first, second, third = item_ids(batch)
    transitions.rerun(batch, items=[first, second, third], requires=LARGE, now=T0)
    big = make_worker("big")

    # Released: queued again with its requirement, the attempt refunded.
    job = transitions.claim_next(big, labels=LARGE, now=later(1))
    transitions.release(job, job.lease_token, worker=big, now=later(2))
    job.refresh_from_db()
    assert (job.status, job.requires, job.attempts, job.run) == (
        "queued",
        LARGE,
        0,
        2,
    )
    # Reclaimed after its lease expired: the same, the attempt counted.
    job = transitions.claim_next(big, labels=LARGE, now=later(3))
    expired = later(3) + lease_duration() + timedelta(seconds=1)
    assert transitions.reclaim_expired(now=expired) == {"requeued": 1, "failed": 0}
    job.refresh_from_db()
    assert (job.status, job.requires, job.attempts) == ("queued", LARGE, 1)
    assert transitions.claim_next(worker, now=expired) is None  # still routed
    # Cancelled: nothing will run, so nothing is required any more.
    assert transitions.cancel_job(job, now=expired)
    job.refresh_from_db()
    assert (job.status, job.requires) == ("cancelled", {})
    transitions.cancel_batch(batch, now=expired)
    assert list(Job.objects.values_list("requires", flat=True)) == [{}, {}, {}]
    assert JobRun.objects.count() == 3  # the runs before stay in the history
    assert not transitions.recount(batch.pk, now=expired)
    assert_consistent(expired)


def test_a_rerun_run_fails_for_good_after_its_own_attempts(settings):
    settings.RECALL_MAX_ATTEMPTS = 2
    batch = make_batch(1)
    worker = make_worker()
    for _ in range(2):  # both attempts of the first run fail
        job = transitions.claim_next(worker, now=T0)
        transitions.fail(job, job.lease_token, worker=worker, error="e", now=T0)
        Job.objects.filter(pk=job.pk).update(available_at=T0)
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED

    transitions.rerun(batch, items=item_ids(batch), now=later(1))

    job = transitions.claim_next(worker, now=later(2))
    assert job is not None and job.attempts == 1
    run = JobRun.objects.get()
    assert (run.attempts, run.status) == (2, "failed")


def test_the_long_poll_probe_names_each_job_its_full_requirement():
    batch = make_batch(2)
    worker = make_worker()
    finish_all(batch, worker)
    Batch.objects.filter(pk=batch.pk).update(requires={"gpu": "a100"})
    first, second = item_ids(batch)
    transitions.rerun(batch, items=[first], requires=LARGE, now=T0)

    found, requires = claimable_work(10, now=later(1))
    assert (found, requires) == (1, [{"gpu": "a100", "model": "large-v3"}])
    transitions.rerun(batch, items=[second], now=T0)
    found, requires = claimable_work(10, now=later(1))
    assert found == 2 and {"gpu": "a100"} in requires
    assert combined({"model": "a"}, {"model": "b"}) is None
    assert combined({}, {}) == {}


def test_a_purge_deletes_the_earlier_runs_with_their_jobs():
    batch = make_batch(2)
    worker = make_worker()
    finish_all(batch, worker)
    transitions.rerun(batch, items=item_ids(batch), now=later(1))
    finish_all(batch, worker, now=later(2))
    assert JobRun.objects.count() == 2

    while not transitions.purge_batch_chunk(
        batch.pk, finished_before=later(3), limit=1
    ).batch_deleted:
        pass

    assert not JobRun.objects.exists() and not Job.objects.exists()
