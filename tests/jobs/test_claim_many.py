"""Many leases per claim: ``"max_jobs": N`` on ``POST /api/v1/claim`` and
``transitions.claim_many``, which makes up to N single claims in a row.

The pinned shapes: ``200 {"jobs": [job, ...]}`` with 1 to N jobs, each exactly
what a single claim answers; 204 when none; never past the worker's lease cap
(429 only when it is at the cap already); 400 for any other ``max_jobs``; and
the N jobs shared out among batches as N single claims in a row would share
them.
"""

from __future__ import annotations

import json

import pytest
from django.db import transaction

from api.waiter import ClaimRequest
from api.worker_views import claims_for_waiting
from batches.models import Batch
from jobs import transitions
from jobs.exceptions import TooManyLeases
from jobs.models import Job, JobStatus, Lease, Worker
from tests.support.factories import (
    T0,
    WorkerClient,
    assert_consistent,
    later,
    make_batch,
    make_worker,
)
from tests.support.threads import run_threads

BACKENDS = ["auto", "orm"]  # on SQLite both are the ORM backend

GPU = {"gpu": "a100"}


def require(batch: Batch, requires: dict[str, str]) -> Batch:
    Batch.objects.filter(pk=batch.pk).update(requires=requires)
    return batch


def _error(response, detail: str) -> None:
    assert response.status_code == 400, response.content
    assert response.json() == {"error": "bad_request", "detail": detail}


# --- The endpoint ------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("value", "given"),
    [
        (0, "0"),
        (-1, "-1"),
        (33, "33"),
        (10**30, str(10**30)),
        (1.5, "1.5"),
        (4.0, "4.0"),
        ("4", "a string"),
        (True, "a boolean"),
        (False, "a boolean"),
        (None, "null"),
        ([4], "an array"),
        ({"n": 4}, "an object"),
    ],
)
def test_a_max_jobs_out_of_range_or_ill_typed_is_400(api, value, given):
    make_batch(2)

    response = api.post("/api/v1/claim", {"max_jobs": value})

    _error(response, f"Field 'max_jobs' must be an integer from 1 to 32, not {given}.")
    assert not Job.objects.filter(status=JobStatus.LEASED).exists()


@pytest.mark.django_db
def test_max_jobs_answers_a_list_of_exactly_what_single_claims_answer(api):
    batch = make_batch(5)

    response = api.post("/api/v1/claim", {"max_jobs": 3})

    assert response.status_code == 200
    body = response.json()
    assert list(body) == ["jobs"]
    assert len(body["jobs"]) == 3
    single = api.claim().json()
    assert list(single) == ["job"]
    for answer in body["jobs"]:
        job = Job.objects.select_related("item").get(pk=answer["id"])
        assert (job.status, job.leased_by_id) == (JobStatus.LEASED, api.worker.pk)
        assert answer == {
            "id": job.pk,
            "lease_token": job.lease_token,
            "lease_expires_at": job.lease_expires_at.isoformat(),
            "lease_seconds": single["job"]["lease_seconds"],
            "heartbeat_interval": single["job"]["heartbeat_interval"],
            "attempt": 1,
            "max_attempts": job.max_attempts,
            "batch": {"id": batch.pk, "name": batch.name},
            "item": {
                "id": job.item_id,
                "source": job.item.source,
                "params": job.item.params,
                "duration_seconds": None,
            },
        }
        assert answer.keys() == single["job"].keys()
    # Each its own lease: distinct tokens, each with its ledger row.
    assert len({a["lease_token"] for a in body["jobs"]}) == 3
    assert Lease.objects.filter(ended_at__isnull=True).count() == 4
    # Fewer left than asked for: what there is (1 to N).
    rest = api.post("/api/v1/claim", {"max_jobs": 32}).json()["jobs"]
    assert len(rest) == 1
    # None left: 204, as a single claim.
    empty = api.post("/api/v1/claim", {"max_jobs": 4})
    assert (empty.status_code, empty.content) == (204, b"")
    assert_consistent()


@pytest.mark.django_db
def test_max_jobs_never_takes_more_than_the_room_under_the_cap(api, settings):
    settings.RECALL_MAX_LEASES_PER_WORKER = 5
    make_batch(10)
    assert api.claim().status_code == 200
    assert api.claim().status_code == 200

    taken = api.post("/api/v1/claim", {"max_jobs": 8})

    assert len(taken.json()["jobs"]) == 3  # the room left: 5 - 2
    assert Job.objects.filter(leased_by=api.worker).count() == 5
    # At the cap already: the same 429 as a single claim's.
    refused = api.post("/api/v1/claim", {"max_jobs": 8})
    single = api.claim()
    assert refused.status_code == single.status_code == 429
    assert refused.json() == single.json()
    assert refused.json()["error"] == "too_many_leases"
    assert refused["Retry-After"] == single["Retry-After"]
    assert Job.objects.filter(leased_by=api.worker).count() == 5


@pytest.mark.django_db
def test_max_jobs_with_labels_takes_only_work_they_serve(api):
    require(make_batch(2, name="gpu", priority=5), GPU)
    make_batch(2, name="anyone")

    plain = api.post("/api/v1/claim", {"max_jobs": 8}).json()["jobs"]
    routed = api.post("/api/v1/claim", {"max_jobs": 8, "labels": GPU}).json()["jobs"]

    assert [job["batch"]["name"] for job in plain] == ["anyone", "anyone"]
    assert [job["batch"]["name"] for job in routed] == ["gpu", "gpu"]
    assert Worker.objects.get(pk=api.worker.pk).labels == GPU


@pytest.mark.django_db
def test_a_woken_claim_with_max_jobs_is_answered_with_its_jobs(api):
    make_batch(3)
    kept = ClaimRequest(wait_seconds=30, max_jobs=2)

    (body,) = claims_for_waiting([(f"Bearer {api.worker.token}", kept)])

    jobs = json.loads(body)["jobs"]
    assert len(jobs) == 2
    assert all(
        Job.objects.get(pk=job["id"]).leased_by_id == api.worker.pk for job in jobs
    )
    assert json.loads(kept.body()) == {"wait_seconds": 30, "max_jobs": 2}


# --- The transition ------------------------------------------------------------------


def _claims(worker: Worker, *, many: bool, n: int) -> list[int]:
    """The batches of n jobs claimed in one claim_many, or in n single claims;
    rolled back afterwards, so both start from the same rows."""
    with transaction.atomic():
        if many:
            jobs = transitions.claim_many(worker, max_jobs=n, now=T0)
        else:
            jobs = [transitions.claim_next(worker, now=T0) for _ in range(n)]
        batches = [job.batch_id for job in jobs if job is not None]
        transaction.set_rollback(True)
    return batches


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_call_shares_its_jobs_out_as_single_claims_in_a_row_would(
    settings, backend
):
    """Two batches of one priority with weights 1 and 2 (and a capped one):
    the batches of the 12 jobs one call takes are those, in order, of 12 single
    claims from the same rows."""
    settings.RECALL_TRANSITIONS_BACKEND = backend
    light, heavy = make_batch(20, name="light"), make_batch(20, name="heavy")
    capped = make_batch(20, name="capped")
    Batch.objects.filter(pk=heavy.pk).update(weight=2)
    Batch.objects.filter(pk=capped.pk).update(max_in_flight=2)
    worker = make_worker()

    many = _claims(worker, many=True, n=12)
    single = _claims(worker, many=False, n=12)

    assert many == single
    assert (many.count(light.pk), many.count(heavy.pk), many.count(capped.pk)) == (
        4,
        6,
        2,
    )


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_claim_many_stops_at_the_cap_and_refuses_only_at_it(settings, backend):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    make_batch(10)
    worker = make_worker()

    assert len(transitions.claim_many(worker, max_jobs=3, now=T0, max_leases=4)) == 3
    # The worker as the next request's authentication loads it.
    (worker, _) = transitions.authenticate_worker(worker.token)
    assert len(transitions.claim_many(worker, max_jobs=3, now=T0, max_leases=4)) == 1
    with pytest.raises(TooManyLeases):
        transitions.claim_many(worker, max_jobs=3, now=T0, max_leases=4)
    # A stale count of its leases (none) never lets it past the cap either.
    stale = Worker.objects.get(pk=worker.pk)
    with pytest.raises(TooManyLeases):
        transitions.claim_many(stale, max_jobs=3, now=T0, max_leases=4)
    assert Job.objects.filter(leased_by=worker).count() == 4
    assert transitions.claim_many(worker, max_jobs=2, now=T0, max_leases=10) != []
    assert_consistent()


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_claim_many_reclaims_expired_leases_first(settings, backend):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    make_batch(2)
    first, second = make_worker("first"), make_worker("second")
    assert len(transitions.claim_many(first, max_jobs=2, now=T0)) == 2

    jobs = transitions.claim_many(second, max_jobs=5, now=later(61))

    assert len(jobs) == 2
    assert sorted(job.attempts for job in jobs) == [2, 2]
    assert_consistent(later(61))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", BACKENDS)
def test_simultaneous_max_jobs_claims_never_exceed_the_lease_cap(settings, backend):
    """8 threads of one worker each asking for 8 jobs at once, with a cap of 5
    and 100 jobs free: exactly 5 are leased in all, every call that got none
    was refused (429) and none got more than the cap."""
    settings.RECALL_MAX_LEASES_PER_WORKER = 5
    settings.RECALL_TRANSITIONS_BACKEND = backend
    make_batch(100)
    worker = make_worker()

    def claim_many(i, barrier):
        client = WorkerClient(worker)
        barrier.wait()
        response = client.post("/api/v1/claim", {"max_jobs": 8})
        if response.status_code == 200:
            return [job["id"] for job in response.json()["jobs"]]
        return response.status_code

    outcomes = run_threads(claim_many, 8)

    leased = [job for o in outcomes if isinstance(o, list) for job in o]
    assert len(leased) == len(set(leased)) == 5
    assert all(o == 429 or 1 <= len(o) <= 5 for o in outcomes)
    assert Job.objects.filter(leased_by=worker, status=JobStatus.LEASED).count() == 5
    assert Lease.objects.count() == 5
    assert_consistent(later(1))


# --- The OpenAPI description ---------------------------------------------------------


@pytest.mark.django_db
def test_the_openapi_description_covers_labels_and_max_jobs(api):
    spec = api.client.get("/api/v1/openapi.json").json()
    schemas = spec["components"]["schemas"]
    request = schemas["ClaimRequest"]["properties"]
    assert request["max_jobs"] == {
        **request["max_jobs"],
        "type": "integer",
        "minimum": 1,
        "maximum": 32,
    }
    assert request["labels"]["maxProperties"] == 16
    answer = spec["paths"]["/api/v1/claim"]["post"]["responses"]["200"]
    one_of = answer["content"]["application/json"]["schema"]["oneOf"]
    assert one_of == [
        {"$ref": "#/components/schemas/Claimed"},
        {"$ref": "#/components/schemas/ClaimedMany"},
    ]
    # Real answers have exactly the fields their schemas require.
    make_batch(3)
    job = schemas["LeasedJob"]
    assert schemas["Claimed"]["properties"]["job"] == {
        "$ref": "#/components/schemas/LeasedJob"
    }
    assert schemas["ClaimedMany"]["properties"]["jobs"]["maxItems"] == 32
    single = api.claim().json()
    many = api.post("/api/v1/claim", {"max_jobs": 2, "labels": {"gpu": "a100"}})
    assert list(single) == schemas["Claimed"]["required"] == ["job"]
    assert list(many.json()) == schemas["ClaimedMany"]["required"] == ["jobs"]
    for answer in (single["job"], *many.json()["jobs"]):
        assert sorted(answer) == sorted(job["required"]) == sorted(job["properties"])
