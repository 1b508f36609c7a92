"""Property-based fuzzing of the live worker API against its OpenAPI description.

Schemathesis generates valid and invalid requests for every operation (wrong
types, arrays instead of objects, huge strings, NUL bytes, unknown ids, ...); the
test also steers some of them at real jobs with live, stale and other workers'
tokens. Every response must be documented and match its schema, and none may
be a 5xx.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from batches.models import Batch
from jobs import transitions
from jobs.models import Job, JobStatus, Lease
from recall_site.wsgi import application

from ..factories import make_batch

schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", application)


@pytest.fixture
def in_process():
    """Call the WSGI app in-process the way Django's test client does: without
    closing the test's database connection at the end of each request."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def world(db, in_process):
    """A batch, two workers, live leases of both and some stale tokens."""
    Batch.objects.all().delete()
    make_batch(60, name="fuzz")
    mine, token = transitions.create_worker("fuzzer")
    other, _ = transitions.create_worker("someone-else")
    for worker in (mine, mine, other, mine):
        transitions.claim_next(worker)
    stale = Job.objects.filter(status=JobStatus.LEASED, leased_by=mine).first()
    transitions.release(stale, stale.lease_token, worker=mine)
    return {"token": token, "worker": mine}


def _steer(case, world) -> None:
    """Point some generated requests at real jobs and real (live or stale) tokens,
    deterministically from the generated values."""
    job_ids = list(Job.objects.order_by("pk").values_list("pk", flat=True))
    tokens = list(Lease.objects.order_by("pk").values_list("token", flat=True))
    job_id = (case.path_parameters or {}).get("job_id")
    if isinstance(job_id, int) and job_id % 3:
        case.path_parameters["job_id"] = job_ids[job_id % len(job_ids)]
    body = case.body
    token = body.get("lease_token") if isinstance(body, dict) else None
    if isinstance(token, str) and tokens and len(token) % 2 == 0:
        body["lease_token"] = tokens[len(token) % len(tokens)]
    # Keep a few live leases around for the next examples.
    if Job.objects.filter(status=JobStatus.LEASED).count() < 3:
        transitions.claim_next(world["worker"])


@schema.parametrize()
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@pytest.mark.django_db
def test_worker_api_conforms_and_never_fails(case, world):
    _steer(case, world)

    case.call_and_validate(
        headers={"Authorization": f"Bearer {world['token']}"},
        # A well-formed request with a token that is not the live one is a 409:
        # documented, and right, but not an "acceptance".
        excluded_checks=[positive_data_acceptance],
    )
