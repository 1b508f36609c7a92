"""Worker management: disabling and re-enabling (the admin's actions)."""

import pytest

from jobs import transitions
from jobs.models import Worker
from jobs.tokens import new_worker_token
from tests.support.factories import claim, later, make_batch

pytestmark = pytest.mark.django_db


def _error_code(response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]


def test_disable_refuses_the_worker_at_once_and_enable_lets_it_back(api, worker):
    assert transitions.set_worker_active(worker, False) is True
    assert (
        transitions.set_worker_active(worker, False) is False
    )  # already disabled: nothing to do

    assert Worker.objects.get(pk=worker.pk).is_active is False
    assert _error_code(api.claim()) == (403, "forbidden")

    assert transitions.set_worker_active(worker, True) is True
    assert transitions.set_worker_active(worker, True) is False
    assert api.claim().status_code == 204


def test_a_disabled_workers_lease_runs_out_and_is_reclaimed(api, worker):
    make_batch(1)
    job = claim(worker)
    transitions.set_worker_active(worker, False)

    assert _error_code(api.heartbeat(job.pk, job.lease_token)) == (403, "forbidden")
    assert transitions.reclaim_expired(now=later(61)) == {"requeued": 1, "failed": 0}


def test_a_new_worker_token_never_starts_with_a_dash():
    """A token given as an option's value (``recall_worker.py --token TOKEN``)
    must not read as an option itself: one token in 64 began with "-", so
    5,000 tokens would all but surely hold one (1 - (63/64) ** 5000)."""
    tokens = [new_worker_token() for _ in range(5000)]

    assert not [token for token in tokens if token.startswith("-")]
    assert len(set(tokens)) == 5000
    assert {len(token) for token in tokens} == {43}
