"""Property-based fuzzing of the live worker and operator APIs against their
OpenAPI description.

Schemathesis generates valid and invalid requests for every operation (wrong
types, arrays instead of objects, huge strings, NUL bytes, unknown ids, ...); the
test also steers some of them at real jobs with live, stale and other workers'
tokens. The operator API's operations are steered at real batches, with a
token whose user may do everything. Every response must be documented and
match its schema, and none may be a 5xx.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from batches.models import Batch
from batches.streaming import EXPORT_SLOTS
from jobs import transitions
from jobs.models import Job, JobStatus, Lease
from jobs.tokens import MAX_TOKEN_LENGTH
from recall_site.wsgi import application
from tests.support.factories import make_batch, make_user

schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", application)
worker_schema = schema.include(tag="worker")
operator_schema = schema.include(tag="operator")


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


def _auth(case, token: str) -> dict[str, str]:
    """The real token in place of the generated one, unless the case left the
    header out on purpose: a negative case that drops ``Authorization`` must
    reach the API without it (a 401), or the request it describes as invalid
    would be valid and its other mutations, if none survives serialisation
    (an extra query parameter with an empty name, say), would read as accepted
    negative data."""
    if "Authorization" not in (case.headers or {}):
        return {}
    return {"Authorization": f"Bearer {token}"}


def _steerable(token) -> bool:
    """Whether a generated token may be swapped for a real one: some of the
    tokens the schema allows (1 to MAX_TOKEN_LENGTH characters). A token
    the case made invalid on purpose (too long, empty) stays: swapped, the
    request would be valid and its acceptance would read as accepted
    negative data."""
    return (
        isinstance(token, str)
        and 0 < len(token) <= MAX_TOKEN_LENGTH
        and len(token) % 2 == 0
    )


def _steer(case, world) -> None:
    """Point some generated requests at real jobs and real (live or stale) tokens,
    deterministically from the generated values."""
    job_ids = list(Job.objects.order_by("pk").values_list("pk", flat=True))
    tokens = list(Lease.objects.order_by("pk").values_list("token", flat=True))
    job_id = (case.path_parameters or {}).get("job_id")
    # Negative ids are left alone: they are the invalid examples.
    if isinstance(job_id, int) and job_id > 0 and job_id % 3:
        case.path_parameters["job_id"] = job_ids[job_id % len(job_ids)]
    body = case.body
    token = body.get("lease_token") if isinstance(body, dict) else None
    if _steerable(token) and tokens:
        body["lease_token"] = tokens[len(token) % len(tokens)]
    # A batched heartbeat's leases and a batched completion's results: most of
    # them real jobs, some with real tokens.
    leases = body.get("leases") if isinstance(body, dict) else None
    results = body.get("results") if isinstance(body, dict) else None
    for lease in [
        *(leases if isinstance(leases, list) else []),
        *(results if isinstance(results, list) else []),
    ]:
        if not isinstance(lease, dict):
            continue
        job_id, token = lease.get("job_id"), lease.get("lease_token")
        if isinstance(job_id, int) and job_id % 3:
            lease["job_id"] = job_ids[job_id % len(job_ids)]
        if _steerable(token) and tokens:
            lease["lease_token"] = tokens[len(token) % len(tokens)]
    # Keep a few live leases around for the next examples.
    if Job.objects.filter(status=JobStatus.LEASED).count() < 3:
        transitions.claim_next(world["worker"])


@worker_schema.parametrize()
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@pytest.mark.django_db
def test_worker_api_conforms_and_never_fails(case, world):
    _steer(case, world)

    case.call_and_validate(
        headers=_auth(case, world["token"]),
        # A well-formed request with a token that is not the live one is a 409:
        # documented, and right, but not an "acceptance".
        excluded_checks=[positive_data_acceptance],
    )


@pytest.fixture
def operator_world(db, in_process):
    """Batches in several states and an Operators user's API token."""
    from operator_api import tokens

    Batch.objects.all().delete()
    batches = [make_batch(5, name=f"fuzz-{n}") for n in range(3)]
    worker, _ = transitions.create_worker("fuzzer")
    job = transitions.claim_next(worker)
    transitions.fail(job, job.lease_token, worker=worker, error="x", retryable=False)
    transitions.pause_batch(batches[1])
    user = make_user("fuzz-operator", "Operators")
    _, token = tokens.issue_token(user, label="fuzz", now=transitions.now())
    yield {"token": token}
    # Schemathesis' WSGI transport reads an export without closing it (a real
    # server closes it), so the export's slot would stay taken: give it back.
    EXPORT_SLOTS.in_use = 0


def _steer_operator(case) -> None:
    """Point most generated batch ids at real batches and most cursors at real
    ids, deterministically from the generated values."""
    batch_ids = list(Batch.objects.order_by("pk").values_list("pk", flat=True))
    batch_id = (case.path_parameters or {}).get("batch_id")
    # Negative ids are left alone: they are the invalid examples.
    if batch_ids and isinstance(batch_id, int) and batch_id > 0 and batch_id % 4:
        case.path_parameters["batch_id"] = batch_ids[batch_id % len(batch_ids)]


@operator_schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@pytest.mark.django_db
def test_operator_api_conforms_and_never_fails(case, operator_world):
    _steer_operator(case)

    case.call_and_validate(
        headers=_auth(case, operator_world["token"]),
        # Valid-looking requests are refused on purpose too: an unknown batch
        # (404), a source with a disallowed scheme (400), a reused key (409).
        excluded_checks=[positive_data_acceptance],
    )
