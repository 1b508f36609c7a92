"""`make demo` shows a re-run (issue 29): a demo batch that finishes with
transcripts flagged short has them re-run once, through the real transition,
on the workers offering model=large-v3 (gpu-1 alone); the batch runs again,
finishes again, and each re-run item keeps its earlier run."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from batches.labels import satisfies
from batches.models import Batch
from jobs import transitions
from jobs.models import Event, Job, JobRun, JobStatus
from tests.support.factories import finished_events, jobs_of, make_batch, make_worker

pytestmark = pytest.mark.django_db


def _demo():
    from tests.test_demo_reclaims import _demo as load

    return load()


_DEMO = _demo()


def _complete_all(batch: Batch, worker, text_for) -> None:
    """Claim, as the demo worker ``worker`` (its demo labels), and complete
    every job it may take, each with the transcript ``text_for(job)``."""
    labels = _DEMO.WORKER_LABELS[worker.name]
    while (job := transitions.claim_next(worker, labels=labels)) is not None:
        assert job.batch_id == batch.pk
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": text_for(job)}
        )


def test_the_re_run_requirement_is_one_only_gpu_1_offers():
    offering = [
        name
        for name, labels in _DEMO.WORKER_LABELS.items()
        if satisfies(labels, _DEMO.RERUN_REQUIRES)
    ]

    assert offering == ["gpu-1"]
    assert _DEMO.RERUN_FLAG == "short"


def test_a_finished_batch_re_runs_its_short_items_once_and_finishes_again():
    get_user_model().objects.create_user(_DEMO.ADMIN, password="pw")
    # Two minutes each: 40 words is not short, one word is.
    batch = make_batch(name="Demo: field interviews", durations=[120, 120, 120, 20])
    gpu2, gpu1 = make_worker("gpu-2"), make_worker("gpu-1")
    items = [job.item_id for job in jobs_of(batch)]
    mumbled = {items[0], items[2]}
    # The fourth item (20 s) is never short, however few its words.
    _complete_all(
        batch,
        gpu2,
        lambda job: (
            "hello"
            if job.item_id in mumbled or job.item_id == items[3]
            else " ".join(["word"] * 40)
        ),
    )
    batch.refresh_from_db()
    assert batch.finished_at is not None
    reruns = _DEMO.Reruns()

    first = reruns.new_lines()

    assert first == [
        "re-run: Demo: field interviews finished with 2 transcripts flagged short; "
        "re-running them on the workers offering model=large-v3 (the batch page's "
        "Re-run, as demo)"
    ]
    batch.refresh_from_db()
    assert batch.finished_at is None
    assert batch.counts()["queued"] == 2
    rerun = Job.objects.filter(batch=batch, item_id__in=mumbled)
    assert sorted(rerun.values_list("status", "run", "requires")) == [
        (JobStatus.QUEUED, 2, {"model": "large-v3"}),
        (JobStatus.QUEUED, 2, {"model": "large-v3"}),
    ]
    assert sorted(JobRun.objects.values_list("job__item_id", "number", "flags")) == [
        (item, 1, ["short"]) for item in sorted(mumbled)
    ]
    assert list(
        Event.objects.filter(batch=batch, kind=Event.Kind.RERUN).values_list(
            "actor__username", flat=True
        )
    ) == ["demo"]
    assert reruns.new_lines() == []  # not finished: nothing new to say
    assert reruns.settled() is False
    # gpu-2 does not offer model=large-v3: only gpu-1 takes the re-run.
    assert transitions.claim_next(gpu2, labels=_DEMO.WORKER_LABELS["gpu-2"]) is None
    _complete_all(batch, gpu1, lambda job: " ".join(["word"] * 40))

    second = reruns.new_lines()

    assert second == [
        "re-run: Demo: field interviews finished again; each re-run item's page "
        "shows its earlier run (2 items)"
    ]
    assert len(finished_events(batch)) == 2
    assert reruns.new_lines() == []  # once: it is not re-run a second time
    assert reruns.settled() is True
    assert JobRun.objects.count() == 2
    assert sorted(rerun.values_list("status", "run", "leased_by__name")) == [
        (JobStatus.COMPLETED, 2, None),
        (JobStatus.COMPLETED, 2, None),
    ]


def test_a_batch_finished_without_short_items_is_not_re_run():
    get_user_model().objects.create_user(_DEMO.ADMIN, password="pw")
    batch = make_batch(name="Demo: press calls (urgent)", durations=[60, 60])
    gpu2 = make_worker("gpu-2")
    _complete_all(batch, gpu2, lambda job: " ".join(["word"] * 40))
    reruns = _DEMO.Reruns()

    assert reruns.new_lines() == []
    assert reruns.settled() is True
    assert JobRun.objects.count() == 0
    batch.refresh_from_db()
    assert batch.finished_at is not None
