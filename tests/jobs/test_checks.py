"""The one-completion-per-completed-job invariant, each way it can break (rows
written behind Recall's back, as a faulty migration or a manual fix would)."""

import pytest

from engine.checks import find_violations
from jobs import transitions
from jobs.models import Job, JobStatus, Lease, LeaseEnd
from tests.support.factories import claim, later, make_batch

pytestmark = pytest.mark.django_db

CHECK = "one-completion-per-completed-job"


def _completed(worker, at: float) -> Job:
    job = claim(worker, now=later(at))
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "hi"}, now=later(at + 1)
    )
    return job


def _found() -> list[str]:
    return [v.detail for v in find_violations(now=later(10)) if v.check == CHECK]


def test_a_consistent_database_has_no_completion_violation(worker):
    make_batch(3)
    _completed(worker, 0)
    claim(worker, now=later(2))

    assert _found() == []


def test_a_completed_job_without_its_completed_ledger_row(worker):
    make_batch(2)
    job = _completed(worker, 0)
    Lease.objects.filter(job=job).update(end_reason=LeaseEnd.RELEASED)

    assert _found() == [f"job {job.pk} is completed with 0 completed ledger rows"]


def test_a_job_completed_twice_in_the_ledger(worker):
    make_batch(2)
    job = _completed(worker, 0)
    row = Lease.objects.get(job=job)
    row.pk = None
    row.token = "a-second-completion"
    row.save()

    assert _found() == [f"job {job.pk} is completed with 2 completed ledger rows"]


def test_a_queued_job_with_a_completed_ledger_row(worker):
    make_batch(2)
    job = _completed(worker, 0)
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.QUEUED, result=None, finished_at=None
    )

    assert _found() == [f"job {job.pk} is queued with 1 completed ledger rows"]
