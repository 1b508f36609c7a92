"""``POST /api/v1/heartbeat``: a worker's leases renewed in one call, through the
HTTP stack. Each lease is answered as the single heartbeat would answer it."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.test import Client

from jobs import transitions
from jobs.models import Job, Lease
from tests.support.factories import (
    NO_SUCH_JOB,
    WorkerClient,
    bad_request_detail,
    claimed_job,
    make_batch,
    make_worker,
    snapshot,
)

pytestmark = pytest.mark.django_db

X = NO_SUCH_JOB  # short, for the tables of bad calls


def test_renewed_lost_and_unknown_leases_in_one_call(api, other_api):
    make_batch(5)
    mine, wrong, done, released = (claimed_job(api) for _ in range(4))
    theirs = claimed_job(other_api)
    api.complete(done["id"], done["lease_token"])
    api.release(released["id"], released["lease_token"])
    untouched = snapshot(*Job.objects.filter(pk__in=[theirs["id"], wrong["id"]]))

    response = api.heartbeat_many(
        [
            (theirs["id"], theirs["lease_token"]),  # another worker's lease
            (mine["id"], mine["lease_token"]),
            (999_999, "t"),
            (wrong["id"], "not-my-token"),
            (done["id"], done["lease_token"]),
            (released["id"], released["lease_token"]),
            (2**63, "t"),
            (-4, "t"),
        ]
    )

    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    answers = response.json()
    assert list(answers) == ["leases"]
    renewed = answers["leases"][1]
    assert list(renewed) == ["job_id", "lease_expires_at"]
    expires = datetime.fromisoformat(renewed["lease_expires_at"])
    assert answers["leases"] == [
        {"job_id": theirs["id"], "error": "lease_lost"},
        {"job_id": mine["id"], "lease_expires_at": renewed["lease_expires_at"]},
        {"job_id": 999_999, "error": "not_found"},
        {"job_id": wrong["id"], "error": "lease_lost"},
        {"job_id": done["id"], "error": "lease_lost"},
        {"job_id": released["id"], "error": "lease_lost"},
        {"job_id": 2**63, "error": "not_found"},
        {"job_id": -4, "error": "not_found"},
    ]
    job = Job.objects.get(pk=mine["id"])
    assert job.lease_expires_at == expires == job.heartbeat_at + timedelta(seconds=60)
    assert Lease.objects.get(token=mine["lease_token"]).expires_at == expires
    assert (
        snapshot(*Job.objects.filter(pk__in=[theirs["id"], wrong["id"]])) == untouched
    )


def test_answers_in_the_single_heartbeats_format(api):
    make_batch(2)
    jobs = [claimed_job(api) for _ in range(2)]

    single = api.heartbeat(jobs[0]["id"], jobs[0]["lease_token"]).json()
    batched = api.heartbeat_many([(j["id"], j["lease_token"]) for j in jobs]).json()

    # One isoformat for both: the same string shape, to the microsecond.
    first, second = (lease["lease_expires_at"] for lease in batched["leases"])
    assert first == second
    assert len(first) == len(single["lease_expires_at"])
    assert first[-6:] == single["lease_expires_at"][-6:] == "+00:00"
    assert datetime.fromisoformat(first) >= datetime.fromisoformat(
        single["lease_expires_at"]
    )


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({}, "Missing field 'leases'"),
        ({"leases": {"job_id": X}}, "'leases' must be an array, not an object"),
        ({"leases": None}, "'leases' must be an array, not null"),
        ({"leases": []}, "must hold 1 to 64 leases, not 0"),
        (
            {"leases": [{"job_id": X + n, "lease_token": "t"} for n in range(65)]},
            "must hold 1 to 64 leases, not 65",
        ),
        ({"leases": [5]}, "leases[0] must be an object with exactly the fields"),
        ({"leases": [{"job_id": X}]}, "leases[0] must be an object with exactly"),
        ({"leases": [{"lease_token": "t"}]}, "leases[0] must be an object with exactly"),
        (
            {"leases": [{"job_id": X, "lease_token": "t", "progress": 0.5}]},
            "leases[0] must be an object with exactly",
        ),
        ({"leases": [{"job_id": "1", "lease_token": "t"}]}, "leases[0].job_id must be an integer, not a string"),
        ({"leases": [{"job_id": 1.0, "lease_token": "t"}]}, "leases[0].job_id must be an integer, not a number"),
        ({"leases": [{"job_id": True, "lease_token": "t"}]}, "leases[0].job_id must be an integer, not a boolean"),
        ({"leases": [{"job_id": None, "lease_token": "t"}]}, "leases[0].job_id must be an integer, not null"),
        ({"leases": [{"job_id": X, "lease_token": 5}]}, "leases[0].lease_token must be a string of 1 to 256"),
        ({"leases": [{"job_id": X, "lease_token": ""}]}, "leases[0].lease_token must be a string of 1 to 256"),
        ({"leases": [{"job_id": X, "lease_token": "x" * 257}]}, "leases[0].lease_token must be a string of 1 to 256"),
        (
            {"leases": [{"job_id": X, "lease_token": "a"}, {"job_id": X + 1, "lease_token": "b"}, {"job_id": X, "lease_token": "c"}]},
            f"leases[2] names job {X} again",
        ),
        ({"leases": [{"job_id": X, "lease_token": "a\x00"}]}, "NUL"),
    ],
)  # fmt: skip
def test_every_malformed_call_is_400_and_renews_nothing(body, detail, api):
    make_batch(1)
    job = claimed_job(api)
    before = snapshot(Job.objects.get(pk=job["id"]))
    good = {"job_id": job["id"], "lease_token": job["lease_token"]}
    if (
        isinstance(body.get("leases"), list)
        and body["leases"]
        and len(body["leases"]) < 64
    ):
        body = {"leases": [good, *body["leases"]]}  # a good lease first, renewed never
        detail = detail.replace("leases[0]", "leases[1]").replace(
            "leases[2]", "leases[3]"
        )

    assert detail in bad_request_detail(api.post("/api/v1/heartbeat", body))
    assert snapshot(Job.objects.get(pk=job["id"])) == before


@pytest.mark.parametrize(
    "raw",
    [b"{", b"[]", b'{"leases": NaN}', b"\xff", b'{"leases": [{"job_id": 1e400}]}'],
)
def test_a_body_that_is_not_a_json_object_is_400(raw, api):
    bad_request_detail(api.post("/api/v1/heartbeat", raw=raw))


def test_the_first_of_64_leases_and_the_64th_are_renewed(api, settings):
    settings.RECALL_MAX_LEASES_PER_WORKER = 64
    make_batch(64)
    jobs = [claimed_job(api) for _ in range(64)]

    response = api.heartbeat_many([(j["id"], j["lease_token"]) for j in jobs])

    assert response.status_code == 200
    leases = response.json()["leases"]
    assert [lease["job_id"] for lease in leases] == [j["id"] for j in jobs]
    assert all(set(lease) == {"job_id", "lease_expires_at"} for lease in leases)


def test_unknown_top_level_fields_are_ignored(api):
    make_batch(1)
    job = claimed_job(api)

    response = api.post(
        "/api/v1/heartbeat",
        {"leases": [{"job_id": job["id"], "lease_token": job["lease_token"]}], "v": 2},
    )

    assert response.status_code == 200


def test_authentication_method_and_rate_as_every_worker_call(api, settings):
    anonymous = Client().post("/api/v1/heartbeat", b"{}", "application/json")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"] == "unauthorized"
    wrong_method = Client().get("/api/v1/heartbeat")
    assert (wrong_method.status_code, wrong_method["Allow"]) == (405, "POST")

    settings.RECALL_WORKER_RATE_PER_SECOND = 0.5
    settings.RECALL_WORKER_RATE_BURST = 1
    make_batch(1)
    job = claimed_job(api)
    refused = api.heartbeat_many([(job["id"], job["lease_token"])])
    assert refused.status_code == 429
    assert refused.json()["error"] == "rate_limited"
    assert refused["Retry-After"] == "2"


def test_a_disabled_worker_is_refused(api, worker):
    make_batch(1)
    job = claimed_job(api)
    transitions.set_worker_active(worker, False)

    response = api.heartbeat_many([(job["id"], job["lease_token"])])

    assert (response.status_code, response.json()["error"]) == (403, "forbidden")


def test_the_call_counts_as_the_workers_sign_of_life():
    api = WorkerClient(make_worker("fresh"))
    assert api.worker.last_seen is None

    response = api.heartbeat_many([(1, "t")])

    assert response.json() == {"leases": [{"job_id": 1, "error": "not_found"}]}
    api.worker.refresh_from_db()
    assert api.worker.last_seen is not None


def test_answers_carry_no_cookie_and_pass_the_pages_middlewares(worker, operator):
    client = Client()
    client.force_login(operator)

    response = client.post(
        "/api/v1/heartbeat",
        {"leases": [{"job_id": X, "lease_token": "t"}]},
        "application/json",
        HTTP_AUTHORIZATION=f"Bearer {worker.token}",
    )

    assert response.status_code == 200
    assert sorted(response.headers) == [
        "Content-Length", "Content-Type", "Cross-Origin-Opener-Policy",
        "Referrer-Policy", "X-Content-Type-Options", "X-Frame-Options",
    ]  # fmt: skip
    assert response.cookies == {}


def test_the_batched_heartbeat_is_a_worker_api_path_that_goes_first():
    """It passes the pages' middlewares by, and the server never sheds it nor
    queues it behind claims, exports or uploads (recall_site/gunicorn_worker.py)."""
    from recall_site.gunicorn_worker import urgent
    from recall_site.middleware import WORKER_API_PREFIXES

    assert "/api/v1/heartbeat".startswith(WORKER_API_PREFIXES)
    assert urgent("/api/v1/heartbeat") and urgent("/api/v1/jobs/7/heartbeat")
    assert not urgent("/api/v1/claim") and not urgent("/api/v1/heartbeats")
