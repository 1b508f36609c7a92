"""Re-run under real concurrency (issue 29): threads with their own database
connections and real commits. Workers without a re-run's labels never take its
jobs while workers with them drain them, on both backends; re-runs racing each
other re-run each item once."""

from __future__ import annotations

import pytest

from batches.models import Batch, BatchItem
from jobs import transitions
from jobs.models import Job, JobRun, JobStatus, Lease
from tests.support.factories import (
    assert_consistent,
    finished_events,
    later,
    make_batch,
    make_endpoint,
    make_worker,
)
from tests.support.threads import THREADS, run_threads

pytestmark = pytest.mark.django_db(transaction=True)

LARGE = {"model": "large-v3"}


def _finish(batch: Batch, text: str = "hello") -> None:
    worker = make_worker(f"setup-{batch.pk}")
    while (job := transitions.claim_next(worker, now=later(0))) is not None:
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": text}, now=later(0)
        )


@pytest.mark.parametrize("backend", ["auto", "orm"])
def test_only_workers_with_the_rerun_labels_take_its_jobs(settings, backend):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    settings.RECALL_MAX_LEASES_PER_WORKER = 100
    make_endpoint()
    rerun = make_batch(24, name="rerun", priority=5)
    _finish(rerun)
    items = list(BatchItem.objects.filter(batch=rerun).values_list("pk", flat=True))
    assert transitions.rerun(rerun, items=items, requires=LARGE, now=later(1)) == 24
    plain = make_batch(24, name="plain")
    workers = [make_worker(f"w{i}") for i in range(THREADS)]

    def work(i, barrier):
        labels = LARGE if i % 2 else None
        barrier.wait()
        taken = []
        while (
            job := transitions.claim_next(workers[i], labels=labels, now=later(2))
        ) is not None:
            taken.append(job.batch_id)
            transitions.complete(
                job,
                job.lease_token,
                worker=workers[i],
                result={"text": "many words " * 30},
                now=later(3),
            )
        return taken

    taken = run_threads(work)

    for i, batches in enumerate(taken):
        if not i % 2:
            assert rerun.pk not in batches, f"plain worker {i} took a re-run job"
    assert sum(b == rerun.pk for batches in taken for b in batches) == 24
    assert sum(b == plain.pk for batches in taken for b in batches) == 24
    big = [w.pk for i, w in enumerate(workers) if i % 2]
    assert set(
        Lease.objects.filter(job__batch=rerun, claimed_at=later(2)).values_list(
            "worker", flat=True
        )
    ) <= set(big)
    rerun.refresh_from_db()
    assert rerun.finishes == 2 and rerun.finished_at is not None
    assert [e.generation for e in finished_events(rerun)] == [1, 2]
    assert rerun.counts()["done"] == 24
    assert not transitions.recount(rerun.pk, now=later(4))
    assert_consistent(later(4))


def test_racing_reruns_rerun_each_item_once():
    batch = make_batch(durations=[60.0] * 30)  # "hello" is short for a minute
    _finish(batch)
    assert batch.counts()["flag_short"] == 30

    def rerun(i, barrier):
        barrier.wait()
        return transitions.rerun(batch, flag="short", now=later(1))

    assert sum(run_threads(rerun, n=4)) == 30
    assert JobRun.objects.count() == 30
    assert set(Job.objects.values_list("run", "status")) == {(2, JobStatus.QUEUED)}
    counts = batch.counts()
    assert (counts["queued"], counts["done"], counts["flag_short"]) == (30, 0, 0)
    assert_consistent(later(1))
