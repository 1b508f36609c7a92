"""``POST /api/v1/complete``: several results of one worker in one call, through
the HTTP stack. Each is answered as the single completion would answer it."""

from __future__ import annotations

import pytest
from django.test import Client

from jobs import transitions
from jobs.models import Job, JobStatus
from tests.support.factories import (
    NO_SUCH_JOB,
    WorkerClient,
    assert_consistent,
    bad_request_detail,
    claimed_job,
    finished_events,
    later,
    make_batch,
    make_worker,
    snapshot,
)
from tests.support.threads import run_threads

pytestmark = pytest.mark.django_db

X = NO_SUCH_JOB  # short, for the tables of bad calls
OK = {"text": "ok"}


def test_completed_replayed_lost_and_unknown_in_one_call(api, other_api):
    make_batch(8)
    mine, wrong, replayed, released = (claimed_job(api) for _ in range(4))
    theirs = claimed_job(other_api)
    assert api.complete(replayed["id"], replayed["lease_token"]).status_code == 200
    assert api.release(released["id"], released["lease_token"]).status_code == 200

    response = api.complete_many(
        [
            (theirs["id"], theirs["lease_token"], OK),  # another worker's lease
            (mine["id"], mine["lease_token"], {"text": "mine", "language": "en"}),
            (999_999, "t", OK),
            (wrong["id"], "not-my-token", OK),
            (replayed["id"], replayed["lease_token"], OK),  # a replay
            (released["id"], released["lease_token"], OK),
            (2**63, "t", OK),
            (-4, "t", OK),
            (0, "t", OK),
        ]
    )

    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert response.json() == {
        "results": [
            {"job_id": theirs["id"], "error": "lease_lost"},
            {"job_id": mine["id"], "status": "completed"},
            {"job_id": 999_999, "error": "not_found"},
            {"job_id": wrong["id"], "error": "lease_lost"},
            {"job_id": replayed["id"], "status": "completed"},
            {"job_id": released["id"], "error": "lease_lost"},
            {"job_id": 2**63, "error": "not_found"},
            {"job_id": -4, "error": "not_found"},
            {"job_id": 0, "error": "not_found"},
        ]
    }
    job = Job.objects.get(pk=mine["id"])
    assert (job.status, job.result) == (
        JobStatus.COMPLETED,
        {"text": "mine", "language": "en"},
    )
    assert Job.objects.get(pk=replayed["id"]).result == {"text": "hello"}
    assert Job.objects.get(pk=wrong["id"]).status == JobStatus.LEASED
    assert Job.objects.get(pk=theirs["id"]).status == JobStatus.LEASED
    assert_consistent(later(1))


def test_each_answer_is_what_the_single_completion_answers(api, other_api):
    """The same entries sent alone and together (on two copies of the rows):
    200 completed, 409 lease_lost and 404 not_found alone are completed,
    lease_lost and not_found together."""

    def world(name: str) -> list[tuple[int, str, dict]]:
        batch = make_batch(6, name=name)
        jobs = [claimed_job(api) for _ in range(3)] + [claimed_job(other_api)]
        api.complete(jobs[1]["id"], jobs[1]["lease_token"])
        transitions.pause_batch(batch)
        return [(j["id"], j["lease_token"], OK) for j in jobs] + [(X, "t", OK)]

    alone = []
    for job_id, token, result in world("alone"):
        response = api.complete(job_id, token, result)
        alone.append(
            response.json().get("status") or response.json()["error"]
            if response.status_code in (200, 404, 409)
            else response.status_code
        )
    together = api.complete_many(world("together")).json()["results"]

    assert (
        [a.get("status") or a["error"] for a in together]
        == alone
        == [
            "completed",
            "completed",
            "completed",
            "lease_lost",
            "not_found",
        ]
    )


def test_replaying_the_call_answers_the_same_and_changes_nothing(api):
    batch = make_batch(3)
    jobs = [claimed_job(api) for _ in range(3)]
    asked = [(j["id"], j["lease_token"], {"text": f"t{n}"}) for n, j in enumerate(jobs)]
    first = api.complete_many(asked)
    after = snapshot(*Job.objects.filter(batch=batch))

    again = api.complete_many(asked)

    assert again.status_code == first.status_code == 200
    assert again.json() == first.json()
    assert snapshot(*Job.objects.filter(batch=batch)) == after
    assert len(finished_events(batch)) == 1


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({}, "Missing field 'results'"),
        ({"results": {"job_id": X}}, "'results' must be an array, not an object"),
        ({"results": None}, "'results' must be an array, not null"),
        ({"results": []}, "must hold 1 to 64 completions, not 0"),
        (
            {"results": [{"job_id": X + n, "lease_token": "t", "result": OK} for n in range(65)]},
            "must hold 1 to 64 completions, not 65",
        ),
        ({"results": [5]}, "results[0] must be an object with exactly the fields"),
        ({"results": [{"job_id": X, "lease_token": "t"}]}, "results[0] must be an object with exactly"),
        ({"results": [{"lease_token": "t", "result": OK}]}, "results[0] must be an object with exactly"),
        (
            {"results": [{"job_id": X, "lease_token": "t", "result": OK, "progress": 1}]},
            "results[0] must be an object with exactly",
        ),
        ({"results": [{"job_id": "1", "lease_token": "t", "result": OK}]}, "results[0].job_id must be an integer, not a string"),
        ({"results": [{"job_id": 1.0, "lease_token": "t", "result": OK}]}, "results[0].job_id must be an integer, not a number"),
        ({"results": [{"job_id": True, "lease_token": "t", "result": OK}]}, "results[0].job_id must be an integer, not a boolean"),
        ({"results": [{"job_id": None, "lease_token": "t", "result": OK}]}, "results[0].job_id must be an integer, not null"),
        ({"results": [{"job_id": X, "lease_token": 5, "result": OK}]}, "results[0]: Field 'lease_token' must be a string"),
        ({"results": [{"job_id": X, "lease_token": "", "result": OK}]}, "results[0]: Field 'lease_token' must be 1 to 256"),
        ({"results": [{"job_id": X, "lease_token": "x" * 257, "result": OK}]}, "results[0]: Field 'lease_token' must be 1 to 256"),
        ({"results": [{"job_id": X, "lease_token": "t", "result": "ok"}]}, "results[0]: Field 'result' must be an object"),
        ({"results": [{"job_id": X, "lease_token": "t", "result": {}}]}, "results[0]: Field 'result' must have a string 'text'"),
        ({"results": [{"job_id": X, "lease_token": "t", "result": {"text": "a", "language": 5}}]}, "results[0]: Field 'result.language' must be a string"),
        (
            {"results": [{"job_id": X, "lease_token": "t", "result": {"text": "a", "segments": [{"start": 2, "end": 1, "text": ""}]}}]},
            "results[0]: result.segments[0] must be an object",
        ),
        (
            {"results": [{"job_id": X, "lease_token": "a", "result": OK}, {"job_id": X + 1, "lease_token": "b", "result": OK}, {"job_id": X, "lease_token": "c", "result": OK}]},
            f"results[2] names job {X} again",
        ),
        ({"results": [{"job_id": X, "lease_token": "a\x00", "result": OK}]}, "NUL"),
    ],
)  # fmt: skip
def test_every_malformed_call_is_400_and_completes_nothing(body, detail, api):
    make_batch(2)
    job = claimed_job(api)
    before = snapshot(Job.objects.get(pk=job["id"]))
    good = {"job_id": job["id"], "lease_token": job["lease_token"], "result": OK}
    if (
        isinstance(body.get("results"), list)
        and body["results"]
        and len(body["results"]) < 64
    ):
        # A good completion first: made never.
        body = {"results": [good, *body["results"]]}
        detail = detail.replace("results[0]", "results[1]").replace(
            "results[2]", "results[3]"
        )

    assert detail in bad_request_detail(api.post("/api/v1/complete", body))
    assert snapshot(Job.objects.get(pk=job["id"])) == before


@pytest.mark.parametrize(
    "raw",
    [b"{", b"[]", b'{"results": NaN}', b"\xff", b'{"results": [{"job_id": 1e400}]}'],
)
def test_a_body_that_is_not_a_json_object_is_400(raw, api):
    bad_request_detail(api.post("/api/v1/complete", raw=raw))


def test_a_body_over_the_limit_is_413_as_for_the_single_completion(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    make_batch(1)
    job = claimed_job(api)
    big = {"text": "x" * 2000}

    many = api.complete_many([(job["id"], job["lease_token"], big)])
    single = api.complete(job["id"], job["lease_token"], big)

    assert many.status_code == single.status_code == 413
    assert many.json()["error"] == single.json()["error"] == "payload_too_large"
    assert Job.objects.get(pk=job["id"]).status == JobStatus.LEASED


def test_the_first_of_64_completions_and_the_64th_are_made(api, settings):
    settings.RECALL_MAX_LEASES_PER_WORKER = 64
    batch = make_batch(64)
    jobs = [claimed_job(api) for _ in range(64)]

    response = api.complete_many([(j["id"], j["lease_token"], OK) for j in jobs])

    assert response.status_code == 200
    results = response.json()["results"]
    assert results == [{"job_id": j["id"], "status": "completed"} for j in jobs]
    assert Job.objects.filter(batch=batch, status=JobStatus.COMPLETED).count() == 64
    assert len(finished_events(batch)) == 1


def test_unknown_top_level_fields_are_ignored(api):
    make_batch(1)
    job = claimed_job(api)

    response = api.post(
        "/api/v1/complete",
        {
            "results": [
                {"job_id": job["id"], "lease_token": job["lease_token"], "result": OK}
            ],
            "v": 2,
        },
    )

    assert response.status_code == 200


def test_authentication_method_and_rate_as_every_worker_call(api, settings):
    anonymous = Client().post("/api/v1/complete", b"{}", "application/json")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"] == "unauthorized"
    wrong_method = Client().get("/api/v1/complete")
    assert (wrong_method.status_code, wrong_method["Allow"]) == (405, "POST")

    settings.RECALL_WORKER_RATE_PER_SECOND = 0.5
    settings.RECALL_WORKER_RATE_BURST = 1
    make_batch(1)
    job = claimed_job(api)
    refused = api.complete_many([(job["id"], job["lease_token"], OK)])
    assert refused.status_code == 429
    assert refused.json()["error"] == "rate_limited"
    assert Job.objects.get(pk=job["id"]).status == JobStatus.LEASED


def test_a_disabled_worker_is_refused(api, worker):
    make_batch(1)
    job = claimed_job(api)
    transitions.set_worker_active(worker, False)

    response = api.complete_many([(job["id"], job["lease_token"], OK)])

    assert (response.status_code, response.json()["error"]) == (403, "forbidden")


def test_answers_carry_no_cookie_and_pass_the_pages_middlewares(worker, operator):
    client = Client()
    client.force_login(operator)

    response = client.post(
        "/api/v1/complete",
        {"results": [{"job_id": X, "lease_token": "t", "result": OK}]},
        "application/json",
        HTTP_AUTHORIZATION=f"Bearer {worker.token}",
    )

    assert response.status_code == 200
    assert response.json() == {"results": [{"job_id": X, "error": "not_found"}]}
    assert sorted(response.headers) == [
        "Content-Length", "Content-Type", "Cross-Origin-Opener-Policy",
        "Referrer-Policy", "X-Content-Type-Options", "X-Frame-Options",
    ]  # fmt: skip
    assert response.cookies == {}


def test_the_batched_completion_is_a_worker_api_path_that_goes_first():
    """It passes the pages' middlewares by, and the server never sheds it nor
    queues it behind claims, exports or uploads (recall_site/gunicorn_worker.py)."""
    from recall_site.gunicorn_worker import urgent
    from recall_site.middleware import WORKER_API_PREFIXES

    assert "/api/v1/complete".startswith(WORKER_API_PREFIXES)
    assert urgent("/api/v1/complete") and urgent("/api/v1/jobs/7/complete")
    assert not urgent("/api/v1/completed")


def test_the_openapi_description_covers_the_batched_completion(api):
    spec = api.client.get("/api/v1/openapi.json").json()
    operation = spec["paths"]["/api/v1/complete"]["post"]
    assert operation["operationId"] == "complete_many"
    schemas = spec["components"]["schemas"]
    entries = schemas["CompleteManyRequest"]["properties"]["results"]
    assert (entries["minItems"], entries["maxItems"]) == (1, 64)
    assert entries["items"]["required"] == ["job_id", "lease_token", "result"]
    answers = schemas["CompleteMany"]["properties"]["results"]["items"]["oneOf"]
    assert answers[1]["properties"]["error"]["enum"] == ["lease_lost", "not_found"]


@pytest.mark.django_db(transaction=True)
def test_two_workers_batched_completions_at_once_complete_each_job_once():
    """Each of two workers sends its batched completion twice at once (a retry
    before the first answer): every answer is completed, every job completed
    exactly once, and the batch finished once."""
    batch = make_batch(16)
    workers = [make_worker("gpu-a"), make_worker("gpu-b")]
    held = {}
    for worker in workers:
        client = WorkerClient(worker)
        jobs = client.post("/api/v1/claim", {"max_jobs": 8}).json()["jobs"]
        held[worker.pk] = [(j["id"], j["lease_token"], OK) for j in jobs]

    def complete(i, barrier):
        worker = workers[i % 2]
        client = WorkerClient(worker)
        barrier.wait()
        response = client.complete_many(held[worker.pk])
        return response.status_code, response.json()

    outcomes = run_threads(complete, 4)

    for i, (status, body) in enumerate(outcomes):
        assert status == 200
        assert body["results"] == [
            {"job_id": job_id, "status": "completed"}
            for job_id, _, _ in held[workers[i % 2].pk]
        ]
    assert Job.objects.filter(batch=batch, status=JobStatus.COMPLETED).count() == 16
    assert len(finished_events(batch)) == 1
    assert_consistent(later(1))
