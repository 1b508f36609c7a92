"""The worker API v1: shapes and the error contract, through the HTTP stack."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from jobs import transitions
from jobs.models import Job, JobStatus, Lease, Worker
from tests.support.factories import claimed_job, jobs_of, make_batch, snapshot

pytestmark = pytest.mark.django_db


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert set(body) == {"error", "detail"}
    assert body["error"] == code
    assert isinstance(body["detail"], str) and body["detail"]
    return body


# --- Happy paths and shapes -----------------------------------------------------------


def test_claim_returns_the_documented_shape(api):
    batch = make_batch(2, name="podcasts")
    job = jobs_of(batch)[0]
    before = timezone.now()

    body = api.claim().json()

    assert list(body) == ["job"]
    claimed = body["job"]
    assert set(claimed) == {
        "id", "lease_token", "lease_expires_at", "lease_seconds", "heartbeat_interval",
        "attempt", "max_attempts", "batch", "item",
    }  # fmt: skip
    assert claimed["id"] == job.pk
    assert claimed["lease_seconds"] == 60
    assert claimed["heartbeat_interval"] == 20
    assert (claimed["attempt"], claimed["max_attempts"]) == (1, 3)
    assert claimed["batch"] == {"id": batch.pk, "name": "podcasts"}
    assert claimed["item"] == {
        "id": job.item_id,
        "source": job.item.source,
        "params": {},
        "duration_seconds": None,
    }
    expires = datetime.fromisoformat(claimed["lease_expires_at"])
    assert (
        before + timedelta(seconds=59)
        < expires
        < timezone.now() + timedelta(seconds=61)
    )
    assert Job.objects.get(pk=job.pk).lease_token == claimed["lease_token"]


def test_claim_passes_the_params_from_the_manifest(api):
    from engine.manifests import create_batch

    lines = ["source,duration_seconds,language\n", "s3://b/a.wav,12.5,de\n"]
    create_batch("csv", lambda: iter(lines))

    item = claimed_job(api)["item"]
    assert (item["params"], item["duration_seconds"]) == ({"language": "de"}, 12.5)


def test_claim_with_nothing_to_do_is_204_with_an_empty_body(api):
    response = api.claim()

    assert response.status_code == 204
    assert response.content == b""


def test_claim_accepts_an_empty_body(api):
    make_batch(1)

    assert api.post("/api/v1/claim", raw=b"").status_code == 200


def test_a_body_of_whitespace_alone_is_not_json(api):
    make_batch(1)

    response = api.post("/api/v1/claim", raw=b" \n")

    assert response.status_code == 400
    assert response.json()["error"] == "bad_request"
    assert Job.objects.filter(status="leased").count() == 0


def test_heartbeat_complete_fail_release_shapes(api):
    make_batch(4)
    first = claimed_job(api)

    response = api.heartbeat(first["id"], first["lease_token"])
    assert response.status_code == 200
    assert list(response.json()) == ["lease_expires_at"]
    datetime.fromisoformat(response.json()["lease_expires_at"])

    response = api.complete(
        first["id"], first["lease_token"], {"text": "hi", "segments": []}
    )
    assert (response.status_code, response.json()) == (200, {"status": "completed"})

    second = claimed_job(api)
    response = api.fail(second["id"], second["lease_token"], "oom", retryable=True)
    assert (response.status_code, response.json()) == (200, {"status": "queued"})

    third = claimed_job(api)
    response = api.fail(third["id"], third["lease_token"], "bad file", retryable=False)
    assert (response.status_code, response.json()) == (200, {"status": "failed"})

    fourth = claimed_job(api)
    response = api.release(fourth["id"], fourth["lease_token"])
    assert (response.status_code, response.json()) == (200, {"status": "queued"})


def test_fail_is_retryable_by_default(api):
    make_batch(1)
    job = claimed_job(api)

    response = api.post(
        f"/api/v1/jobs/{job['id']}/fail",
        {"lease_token": job["lease_token"], "error": "x"},
    )

    assert response.json() == {"status": "queued"}


def test_replayed_complete_is_200_again(api):
    make_batch(1)
    job = claimed_job(api)
    assert api.complete(job["id"], job["lease_token"]).status_code == 200

    response = api.complete(job["id"], job["lease_token"])

    assert (response.status_code, response.json()) == (200, {"status": "completed"})


def test_every_call_updates_last_seen(api, worker):
    assert worker.last_seen is None
    api.claim()
    assert Worker.objects.get(pk=worker.pk).last_seen is not None


# --- Lease lost ------------------------------------------------------------------------


def test_stale_worker_is_fenced_after_reclaim(api, other_api):
    make_batch(1)
    job = claimed_job(api)
    Job.objects.filter(pk=job["id"]).update(lease_expires_at=timezone.now())
    fresh = claimed_job(other_api)  # reclaims the expired lease first
    assert fresh["id"] == job["id"]
    before = snapshot(Job.objects.get(pk=job["id"]))

    for response in (
        api.heartbeat(job["id"], job["lease_token"]),
        api.complete(job["id"], job["lease_token"]),
        api.fail(job["id"], job["lease_token"]),
        api.release(job["id"], job["lease_token"]),
    ):
        _error(response, 409, "lease_lost")

    assert snapshot(Job.objects.get(pk=job["id"])) == before


def test_another_workers_job_is_409(api, other_api):
    make_batch(1)
    job = claimed_job(api)

    for response in (
        other_api.heartbeat(job["id"], job["lease_token"]),
        other_api.complete(job["id"], job["lease_token"]),
        other_api.fail(job["id"], job["lease_token"]),
        other_api.release(job["id"], job["lease_token"]),
    ):
        _error(response, 409, "lease_lost")
    assert Job.objects.get(pk=job["id"]).status == JobStatus.LEASED


def test_a_wrong_token_is_409(api):
    make_batch(1)
    job = claimed_job(api)

    _error(api.heartbeat(job["id"], "not-my-token"), 409, "lease_lost")


# --- Authentication ---------------------------------------------------------------------


def test_missing_token_is_401():
    response = Client().post(
        "/api/v1/claim", data=b"{}", content_type="application/json"
    )

    _error(response, 401, "unauthorized")
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header", ["Bearer nope-nope-nope", "Bearer ", "Basic abc", "token"]
)
def test_bad_authorization_is_401(header, worker):
    response = Client().post(
        "/api/v1/claim",
        data=b"{}",
        content_type="application/json",
        HTTP_AUTHORIZATION=header,
    )
    _error(response, 401, "unauthorized")


def test_disabled_worker_is_403(api, worker):
    Worker.objects.filter(pk=worker.pk).update(is_active=False)

    _error(api.claim(), 403, "forbidden")


def test_a_rotated_token_stops_working_at_once(api, worker):
    old = worker.token
    new = transitions.rotate_worker_token(worker)

    _error(api.post("/api/v1/claim", {}, token=old), 401, "unauthorized")
    assert api.post("/api/v1/claim", {}, token=new).status_code == 204


def test_session_cookies_are_never_accepted(db):
    User.objects.create_superuser("admin", "a@example.com", "pw")
    client = Client(enforce_csrf_checks=True)
    client.login(username="admin", password="pw")

    _error(client.post("/api/v1/claim"), 401, "unauthorized")


def test_csrf_does_not_apply_to_token_auth(worker):
    client = Client(enforce_csrf_checks=True)
    response = client.post(
        "/api/v1/claim", data=b"{}", content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {worker.token}",
    )  # fmt: skip
    assert response.status_code == 204


def test_answers_carry_the_sites_headers_and_never_a_cookie(worker, operator, settings):
    """The worker API passes the pages' content security policy, static
    files, session, user and message middlewares by (recall_site/middleware.py):
    its answers are as they were, with the site's security headers, and a
    logged-in operator's cookies change nothing, while the pages keep their
    sessions, their policy and their static files."""
    # Static files from the source tree, as collectstatic would gather them
    # (a fresh checkout has none collected).
    settings.WHITENOISE_USE_FINDERS = True
    client = Client()
    client.force_login(operator)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {worker.token}"}
    make_batch(1)

    claim = client.post("/api/v1/claim", b"{}", "application/json", **auth)
    job = claim.json()["job"]
    complete = client.post(
        f"/api/v1/jobs/{job['id']}/complete",
        {"lease_token": job["lease_token"], "result": {"text": "hi"}},
        "application/json",
        **auth,
    )

    for response in (claim, complete):
        assert response.status_code == 200, response.content
        assert sorted(response.headers) == [
            "Content-Length", "Content-Type", "Cross-Origin-Opener-Policy",
            "Referrer-Policy", "X-Content-Type-Options", "X-Frame-Options",
        ]  # fmt: skip
        assert response.cookies == {}
        passed_by = ("csp_nonce", "session", "user", "_messages")
        assert [a for a in passed_by if hasattr(response.wsgi_request, a)] == []
    page = client.get("/workers/")
    assert page.status_code == 200
    assert page.wsgi_request.user == operator
    assert page.headers["Vary"] == "Cookie"
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    script = client.get("/static/js/recall.js")
    assert script.status_code == 200
    assert b"".join(script.streaming_content).startswith(b"// Recall's only script")


def test_tokens_are_stored_only_hashed(worker):
    stored = Worker.objects.filter(pk=worker.pk).values().get()
    assert worker.token not in json.dumps(stored, default=str)
    assert stored["token_prefix"] == worker.token[:8]


# --- Bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["get", "put", "delete", "patch"])
def test_wrong_method_is_405(method, worker):
    response = getattr(Client(), method)(
        "/api/v1/claim", HTTP_AUTHORIZATION=f"Bearer {worker.token}"
    )
    _error(response, 405, "method_not_allowed")
    assert response["Allow"] == "POST"


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/nope",
        "/api/v2/claim",
        "/api/v1/claim/",
        "/api/v1/jobs/1/explode",
        "/api/v1/jobs/-1/heartbeat",
    ],
)
def test_unknown_api_path_is_404_json(path, worker):
    # With CSRF checks on, as a real client meets them (found by the fuzzer).
    client = Client(enforce_csrf_checks=True)
    response = client.post(
        path,
        data=b"{}",
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {worker.token}",
    )
    _error(response, 404, "not_found")


@pytest.mark.parametrize("job_id", [999999, 2**63, 10**30])
def test_unknown_job_is_404(job_id, api):
    _error(api.heartbeat(job_id, "t"), 404, "not_found")


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (b"{", "not valid JSON"),
        (b"[]", "must be a JSON object, not an array"),
        (b'"x"', "must be a JSON object, not a string"),
        (b"42", "must be a JSON object, not a number"),
        (b"null", "must be a JSON object, not null"),
        (b'{"lease_token": NaN}', "not valid JSON"),
        (b'{"lease_token": Infinity}', "not valid JSON"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"lease_token": "a\\u0000b"}', "NUL"),
        (b'{"lease_token": "\\ud800"}', "surrogates"),
    ],
)
def test_malformed_bodies_are_400(raw, detail, api):
    make_batch(1)
    job = claimed_job(api)

    body = _error(
        api.post(f"/api/v1/jobs/{job['id']}/heartbeat", raw=raw), 400, "bad_request"
    )

    assert detail in body["detail"]


def test_claim_with_a_non_object_body_is_400(api):
    _error(api.post("/api/v1/claim", raw=b"[1, 2]"), 400, "bad_request")


@pytest.mark.parametrize(
    ("endpoint", "body", "detail"),
    [
        ("heartbeat", {}, "Missing field 'lease_token'"),
        ("heartbeat", {"lease_token": 5}, "'lease_token' must be a string, not a number"),
        ("heartbeat", {"lease_token": ""}, "1 to 256 characters"),
        ("heartbeat", {"lease_token": "x" * 257}, "1 to 256 characters"),
        ("complete", {"lease_token": "t"}, "Missing field 'result'"),
        ("complete", {"lease_token": "t", "result": "text"}, "must be an object"),
        ("complete", {"lease_token": "t", "result": {}}, "string 'text'"),
        ("complete", {"lease_token": "t", "result": {"text": 1}}, "string 'text'"),
        ("complete", {"lease_token": "t", "result": {"text": "", "segments": {}}}, "array"),
        (
            "complete",
            {"lease_token": "t", "result": {"text": "", "segments": [{"start": 2, "end": 1, "text": ""}]}},
            "segments[0]",
        ),
        (
            "complete",
            {"lease_token": "t", "result": {"text": "", "segments": [{"start": True, "end": 1, "text": ""}]}},
            "segments[0]",
        ),
        ("complete", {"lease_token": "t", "result": {"text": "", "language": 3}}, "language"),
        ("complete", {"lease_token": "t", "result": {"text": "a\x00"}}, "NUL"),
        ("fail", {"lease_token": "t"}, "Missing field 'error'"),
        ("fail", {"lease_token": "t", "error": ["x"]}, "must be a string, not an array"),
        ("fail", {"lease_token": "t", "error": "x", "retryable": "yes"}, "must be a boolean"),
        ("fail", {"lease_token": "t", "error": "x", "retryable": 1}, "must be a boolean"),
        ("release", {"lease_token": None}, "must be a string, not null"),
    ],
)  # fmt: skip
def test_ill_typed_fields_are_400_and_change_nothing(endpoint, body, detail, api):
    make_batch(1)
    job = claimed_job(api)
    before = snapshot(Job.objects.get(pk=job["id"]))

    response = api.post(f"/api/v1/jobs/{job['id']}/{endpoint}", body)

    assert detail in _error(response, 400, "bad_request")["detail"]
    assert snapshot(Job.objects.get(pk=job["id"])) == before


def test_a_body_over_the_limit_is_413(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    make_batch(1)
    job = claimed_job(api)
    big = {"lease_token": job["lease_token"], "result": {"text": "x" * 2000}}

    _error(
        api.post(f"/api/v1/jobs/{job['id']}/complete", big), 413, "payload_too_large"
    )
    assert Job.objects.get(pk=job["id"]).status == JobStatus.LEASED


def test_the_default_limit_takes_a_long_transcript_with_segments(api):
    make_batch(1)
    job = claimed_job(api)
    segments = [
        {"start": i * 2.0, "end": i * 2.0 + 1.9, "text": "word " * 20}
        for i in range(40_000)
    ]
    result = {"text": " ".join(s["text"] for s in segments), "segments": segments}
    payload = json.dumps({"lease_token": job["lease_token"], "result": result}).encode()
    assert 8_000_000 < len(payload) < 10 * 1024 * 1024

    response = api.post(f"/api/v1/jobs/{job['id']}/complete", raw=payload)

    assert response.status_code == 200
    assert len(Job.objects.get(pk=job["id"]).result["segments"]) == 40_000


def test_a_long_error_is_accepted_and_truncated(api):
    make_batch(1)
    job = claimed_job(api)

    response = api.fail(job["id"], job["lease_token"], "E" * 50_000, retryable=False)

    assert response.status_code == 200
    assert len(Lease.objects.get(job_id=job["id"]).error) == 10_000


def test_unknown_fields_are_ignored(api):
    make_batch(1)
    job = claimed_job(api)

    response = api.post(
        f"/api/v1/jobs/{job['id']}/heartbeat",
        {"lease_token": job["lease_token"], "progress": 0.5},
    )

    assert response.status_code == 200


def test_the_openapi_description_is_served_and_covers_every_endpoint(db):
    response = Client().get("/api/v1/openapi.json")

    spec = response.json()
    assert spec["openapi"].startswith("3.")
    # The worker API's operations (the operator API's are tagged "operator").
    assert {
        path
        for path, operations in spec["paths"].items()
        if any("worker" in op["tags"] for op in operations.values())
    } == {
        "/api/v1/claim",
        "/api/v1/jobs/{job_id}/heartbeat",
        "/api/v1/heartbeat",
        "/api/v1/jobs/{job_id}/complete",
        "/api/v1/complete",
        "/api/v1/jobs/{job_id}/fail",
        "/api/v1/jobs/{job_id}/release",
    }
    assert spec["components"]["securitySchemes"]["workerToken"]["scheme"] == "bearer"


def test_a_worker_over_its_lease_cap_gets_429_with_retry_after(api, settings):
    settings.RECALL_MAX_LEASES_PER_WORKER = 2
    make_batch(5)
    held = [api.claim().json()["job"] for _ in range(2)]

    response = api.claim()

    assert response.status_code == 429
    assert response["Retry-After"] == "20"
    assert response.json() == {
        "error": "too_many_leases",
        "detail": "Worker 'gpu-1' already holds 2 live leases (the limit is 2): "
        "finish, fail or release one before claiming more.",
    }
    assert Job.objects.filter(status="leased").count() == 2
    # Finishing one makes room again.
    api.complete(held[0]["id"], held[0]["lease_token"])
    assert api.claim().status_code == 200
