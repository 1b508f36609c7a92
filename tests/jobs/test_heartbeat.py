from datetime import timedelta

import pytest

from jobs import transitions
from jobs.exceptions import LeaseLost
from jobs.models import Job, Lease
from tests.support.factories import claim, later, make_batch, snapshot

pytestmark = pytest.mark.django_db


def test_heartbeat_extends_the_lease_from_now(worker, batch):
    job = claim(worker)

    expires = transitions.heartbeat(job, job.lease_token, worker=worker, now=later(50))

    assert expires == later(50) + timedelta(seconds=60)
    job.refresh_from_db()
    assert (job.lease_expires_at, job.heartbeat_at) == (expires, later(50))
    lease = Lease.objects.get(token=job.lease_token)
    assert (lease.heartbeat_at, lease.expires_at, lease.ended_at) == (
        later(50),
        expires,
        None,
    )


def test_heartbeats_keep_a_long_job_alive_through_sweeps(worker, batch):
    job = claim(worker)
    for t in range(30, 400, 30):
        transitions.heartbeat(job, job.lease_token, worker=worker, now=later(t))
        assert transitions.reclaim_expired(now=later(t + 1)) == {
            "requeued": 0,
            "failed": 0,
        }
    assert Job.objects.get(pk=job.pk).status == "leased"


def test_an_expired_lease_is_still_live_until_reclaimed(worker, batch):
    job = claim(worker)

    expires = transitions.heartbeat(job, job.lease_token, worker=worker, now=later(500))

    assert expires == later(560)
    assert Job.objects.get(pk=job.pk).lease_expires_at == later(560)


@pytest.mark.parametrize(
    "case", ["wrong token", "other worker", "reclaimed", "completed"]
)
def test_heartbeat_without_the_live_lease_is_refused_and_changes_nothing(
    case, worker, other_worker
):
    make_batch(2)
    job = claim(worker)
    token, caller = job.lease_token, worker
    if case == "wrong token":
        token = "not-the-token"
    elif case == "other worker":
        caller = other_worker
    elif case == "reclaimed":
        assert transitions.reclaim_expired(now=later(61))["requeued"] == 1
    elif case == "completed":
        transitions.complete(
            job, token, worker=worker, result={"text": "done"}, now=later(1)
        )
    before = snapshot(job)

    with pytest.raises(
        LeaseLost, match="is not leased to this worker under this token"
    ):
        transitions.heartbeat(job.pk, token, worker=caller, now=later(70))

    assert snapshot(job) == before
