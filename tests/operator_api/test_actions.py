"""pause, resume, cancel and retry over the operator API: the UI's transitions,
answering the batch, each recorded as an event with the token's user."""

from __future__ import annotations

import pytest

from batches.models import Batch, ItemStatus
from jobs import transitions
from jobs.models import Event, Job, JobStatus
from tests.support.factories import claim, jobs_of, later, make_batch, make_worker

pytestmark = pytest.mark.django_db


def _act(api, batch: Batch, action: str, body=None) -> dict:
    response = api.post(f"/api/v1/batches/{batch.pk}/{action}", body)
    assert response.status_code == 200, response.content
    return response.json()


def _events(batch: Batch, kind: str) -> list[tuple[str, str | None]]:
    return [
        (e.kind, e.actor.username if e.actor else None)
        for e in Event.objects.filter(kind=kind).select_related("actor").order_by("pk")
        if e.batch_id == batch.pk or (e.job and e.job.batch_id == batch.pk)
    ]


def test_pause_then_resume(operator_api):
    batch = make_batch(2)

    paused = _act(operator_api, batch, "pause")
    assert paused["changed"] is True
    assert paused["batch"]["id"] == batch.pk and paused["batch"]["state"] == "paused"
    assert Batch.objects.get(pk=batch.pk).paused_at is not None
    assert _act(operator_api, batch, "pause")["changed"] is False

    resumed = _act(operator_api, batch, "resume")
    assert (resumed["changed"], resumed["batch"]["state"]) == (True, "running")
    assert _act(operator_api, batch, "resume")["changed"] is False

    assert _events(batch, Event.Kind.BATCH_PAUSED) == [("batch_paused", "operator")]
    assert _events(batch, Event.Kind.BATCH_RESUMED) == [("batch_resumed", "operator")]


def test_cancel(operator_api):
    batch = make_batch(3)
    worker = make_worker("gpu-1")
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "kept"}, now=later(1)
    )

    body = _act(operator_api, batch, "cancel")

    assert (body["changed"], body["cancelled"]) == (True, 2)
    assert body["batch"]["state"] == "cancelled"
    assert body["batch"]["counts"] == {
        "queued": 0,
        "transcribing": 0,
        "done": 1,
        "failed": 0,
        "cancelled": 2,
    }
    again = _act(operator_api, batch, "cancel")
    assert (again["changed"], again["cancelled"]) == (False, 0)
    assert _events(batch, Event.Kind.BATCH_CANCELLED) == [
        ("batch_cancelled", "operator")
    ]


def _fail_all(batch: Batch) -> None:
    worker = make_worker("gpu-x")
    for n, _ in enumerate(jobs_of(batch)):
        job = claim(worker, now=later(n))
        transitions.fail(
            job,
            job.lease_token,
            worker=worker,
            error="boom",
            retryable=False,
            now=later(n),
        )


def test_retry_failed_items_with_and_without_a_search(operator_api):
    batch = make_batch(3, name="r")
    _fail_all(batch)

    some = _act(operator_api, batch, "retry", {"source_contains": "r-1"})
    assert (some["changed"], some["queued"]) == (True, 1)
    assert (
        some["batch"]["counts"]["queued"] == 1
        and some["batch"]["counts"]["failed"] == 2
    )

    rest = _act(operator_api, batch, "retry")
    assert rest["queued"] == 2
    assert Job.objects.filter(batch=batch, status=JobStatus.QUEUED).count() == 3
    assert [actor for _, actor in _events(batch, Event.Kind.RETRIED)] == [
        "operator"
    ] * 3
    assert _act(operator_api, batch, "retry")["changed"] is False


def test_a_cancelled_batch_cannot_be_retried(operator_api):
    batch = make_batch(1)
    _fail_all(batch)
    transitions.cancel_batch(batch)

    response = operator_api.post(f"/api/v1/batches/{batch.pk}/retry")

    assert response.status_code == 409
    assert response.json() == {
        "error": "invalid_transition",
        "detail": f"Batch {batch.pk} is cancelled: it cannot be retried.",
    }
    assert batch.counts()[ItemStatus.FAILED] == 1


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (
            {"source_contains": 3},
            "Field 'source_contains' must be a string, not a number.",
        ),
        (
            {"source_contains": "x" * 201},
            "Field 'source_contains' must be at most 200 characters.",
        ),
        (  # the schema's limit is on the value sent, spaces included
            {"source_contains": "\r" + "x" * 200},
            "Field 'source_contains' must be at most 200 characters.",
        ),
    ],
)
def test_a_bad_retry_body_is_400(operator_api, body, detail):
    batch = make_batch(1)
    response = operator_api.post(f"/api/v1/batches/{batch.pk}/retry", body)
    assert response.status_code == 400
    assert response.json() == {"error": "bad_request", "detail": detail}


def test_an_action_body_must_be_a_json_object(operator_api):
    batch = make_batch(1)
    response = operator_api.post(f"/api/v1/batches/{batch.pk}/pause", raw=b"[1]")
    assert response.status_code == 400
    assert Batch.objects.get(pk=batch.pk).paused_at is None
