from jobs.models import Job, JobStatus

from ..factories import T0, later


def test_claim_complete(worker, batch):
    job = Job.objects.claim_next(worker, now=T0)
    assert job.status == JobStatus.LEASED
    job.complete(job.lease_token, worker=worker, result={"text": "hi"}, now=later(5))
    job.refresh_from_db()
    assert job.status == JobStatus.COMPLETED
    assert job.item.status == "done"
    assert batch.counts()["done"] == 1
