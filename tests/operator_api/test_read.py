"""Reading over the operator API: batches newest first and items by keyset
pagination (stable while items complete), one batch's progress, exports."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import Client

from batches.models import Batch
from jobs import transitions
from tests.support.clients import ApiClient, token_for
from tests.support.factories import (
    T0,
    claim,
    jobs_of,
    later,
    make_batch,
    make_user,
    make_worker,
)

pytestmark = pytest.mark.django_db


def _pages(api: ApiClient, path: str, key: str, **params) -> list[list[dict]]:
    pages, cursor = [], None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        response = api.get(path, **query)
        assert response.status_code == 200, response.content
        body = response.json()
        assert set(body) == {key, "next_cursor"}
        pages.append(body[key])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages


def test_batches_newest_first_in_pages(viewer_api):
    made = [make_batch(1, name=f"b{i}") for i in range(5)]

    pages = _pages(viewer_api, "/api/v1/batches", "batches", limit=2)

    assert [[b["id"] for b in page] for page in pages] == [
        [made[4].pk, made[3].pk],
        [made[2].pk, made[1].pk],
        [made[0].pk],
    ]
    first = pages[0][0]
    assert (first["name"], first["state"], first["total"]) == ("b4", "running", 1)


def test_batches_by_state(viewer_api, operator):
    running, paused = make_batch(1, name="r"), make_batch(1, name="p")
    transitions.pause_batch(paused, actor=operator)

    def ids(state: str) -> list[int]:
        response = viewer_api.get("/api/v1/batches", state=state)
        return [b["id"] for b in response.json()["batches"]]

    assert ids("paused") == [paused.pk]
    assert ids("running") == [running.pk]
    assert ids("finished") == []


def test_a_full_last_page_has_no_next_cursor(viewer_api):
    [make_batch(1) for _ in range(3)]
    body = viewer_api.get("/api/v1/batches", limit=3).json()
    assert len(body["batches"]) == 3 and body["next_cursor"] is None


@pytest.mark.parametrize(
    ("params", "detail"),
    [
        (
            {"state": "sleeping"},
            "'state' must be one of running, paused, finished, cancelled, stalled.",
        ),
        ({"cursor": "abc"}, "'cursor' must be a next_cursor this API returned."),
        ({"cursor": "-1"}, "'cursor' must be a next_cursor this API returned."),
        (
            {"cursor": "99999999999999999999"},
            "'cursor' must be a next_cursor this API returned.",
        ),
        ({"limit": "0"}, "'limit' must be a whole number from 1 to 100."),
        ({"limit": "101"}, "'limit' must be a whole number from 1 to 100."),
    ],
)
def test_bad_query_parameters_are_400(viewer_api, params, detail):
    batch = make_batch(1)
    for path in ("/api/v1/batches", f"/api/v1/batches/{batch.pk}/items"):
        if path.endswith("items") and "state" in params:
            detail = (
                "'state' must be one of queued, transcribing, done, failed, cancelled."
            )
        response = viewer_api.get(path, **params)
        assert response.status_code == 400
        assert response.json() == {"error": "bad_request", "detail": detail}


def test_an_unknown_batch_is_404(viewer_api, operator_api):
    for path in ("/api/v1/batches/999", "/api/v1/batches/999/items"):
        response = viewer_api.get(path)
        assert response.status_code == 404
        assert response.json() == {
            "error": "not_found",
            "detail": "There is no batch 999.",
        }
    response = operator_api.post("/api/v1/batches/99999999999999999999/pause")
    assert response.status_code == 404


def test_items_with_their_state_attempts_error_and_result(viewer_api):
    batch = make_batch(3, name="it")
    worker = make_worker("gpu-1")
    done, failed, _ = jobs_of(batch)
    a = claim(worker)
    transitions.complete(
        a,
        a.lease_token,
        worker=worker,
        result={"text": "hi", "language": "en"},
        now=later(1),
    )
    b = claim(worker, now=later(2))
    transitions.fail(
        b,
        b.lease_token,
        worker=worker,
        error="bad audio",
        retryable=False,
        now=later(3),
    )

    items = viewer_api.get(f"/api/v1/batches/{batch.pk}/items").json()["items"]

    assert items == [
        {
            "id": done.item_id,
            "source": "file:///audio/it-0.wav",
            "params": {},
            "state": "done",
            "attempts": 1,
            "error": None,
            "result": {"text": "hi", "language": "en"},
            "flags": [],
        },
        {
            "id": failed.item_id,
            "source": "file:///audio/it-1.wav",
            "params": {},
            "state": "failed",
            "attempts": 1,
            "error": "bad audio",
            "result": None,
            "flags": [],
        },
        {
            "id": items[2]["id"],
            "source": "file:///audio/it-2.wav",
            "params": {},
            "state": "queued",
            "attempts": 0,
            "error": None,
            "result": None,
            "flags": [],
        },
    ]
    only_done = viewer_api.get(f"/api/v1/batches/{batch.pk}/items", state="done").json()
    assert [i["id"] for i in only_done["items"]] == [done.item_id]


def test_item_pages_stay_stable_while_items_complete(viewer_api):
    """Each item appears exactly once, in id order, however many items finish
    between one page and the next (keyset, not OFFSET)."""
    batch = make_batch(250, name="many")
    worker = make_worker("gpu-1")
    path = f"/api/v1/batches/{batch.pk}/items"
    all_ids = [j.item_id for j in jobs_of(batch)]

    seen: list[int] = []
    cursor = None
    step = 0
    while True:
        body = viewer_api.get(
            path, limit=40, **({"cursor": cursor} if cursor else {})
        ).json()
        seen += [item["id"] for item in body["items"]]
        # Between pages, 30 items finish (claimed in id order: on both sides
        # of the cursor as the pages move on).
        for _ in range(30):
            job = transitions.claim_next(worker, now=later(step))
            if job is None:
                break
            transitions.complete(
                job,
                job.lease_token,
                worker=worker,
                result={"text": "x"},
                now=later(step),
            )
            step += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break

    assert seen == all_ids


def test_queued_item_pages_never_repeat_while_items_complete(viewer_api):
    batch = make_batch(120, name="q")
    worker = make_worker("gpu-1")
    path = f"/api/v1/batches/{batch.pk}/items"
    seen: list[int] = []
    cursor = None
    while True:
        body = viewer_api.get(
            path, state="queued", limit=25, **({"cursor": cursor} if cursor else {})
        ).json()
        seen += [item["id"] for item in body["items"]]
        assert all(item["state"] == "queued" for item in body["items"])
        for _ in range(10):
            job = transitions.claim_next(worker, now=T0)
            if job is not None:
                transitions.complete(
                    job, job.lease_token, worker=worker, result={"text": "x"}, now=T0
                )
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(set(seen))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_paging_while_a_worker_thread_completes_items():
    """A real worker thread completes items through the worker API while a
    reader pages through every item: no item is missed or repeated."""
    batch = make_batch(300, name="live")
    all_ids = [j.item_id for j in jobs_of(batch)]
    reader = ApiClient(token_for(make_user("reader", "Viewers")))
    worker = make_worker("gpu-1")
    stop = threading.Event()
    completed = []

    def work() -> None:
        try:
            while not stop.is_set():
                job = transitions.claim_next(worker)
                if job is None:
                    return
                transitions.complete(
                    job, job.lease_token, worker=worker, result={"text": "x"}
                )
                completed.append(job.pk)
        finally:
            connection.close()

    thread = threading.Thread(target=work)
    thread.start()
    try:
        pages = _pages(reader, f"/api/v1/batches/{batch.pk}/items", "items", limit=7)
    finally:
        stop.set()
        thread.join()

    seen = [item["id"] for page in pages for item in page]
    assert seen == all_ids
    assert len(pages) == 43
    assert completed  # the worker really ran alongside


def _ui_export(batch: Batch, fmt: str) -> bytes:
    client = Client()
    client.force_login(make_user("ui-exporter", "Operators"))
    response = client.get(f"/batches/{batch.pk}/export.{fmt}")
    assert response.status_code == 200
    return b"".join(response.streaming_content)


@pytest.mark.parametrize(
    ("fmt", "content_type"),
    [
        ("csv", "text/csv; charset=utf-8"),
        ("jsonl", "application/x-ndjson; charset=utf-8"),
        ("zip", "application/zip"),
    ],
)
def test_exports_are_the_uis(operator_api, fmt, content_type):
    batch = make_batch(3, name="exp")
    worker = make_worker("gpu-1")
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "hello"}, now=later(1)
    )

    response = operator_api.get(f"/api/v1/batches/{batch.pk}/export.{fmt}")

    assert response.status_code == 200
    assert response["Content-Type"] == content_type
    name = "transcripts" if fmt == "zip" else "items"
    assert (
        response["Content-Disposition"]
        == f'attachment; filename="batch-{batch.pk}-{name}.{fmt}"'
    )
    content = b"".join(response.streaming_content)
    if fmt == "zip":
        assert content[:2] == b"PK"
    else:
        assert content == _ui_export(batch, fmt)


def test_an_unknown_export_format_is_404(operator_api):
    batch = make_batch(1)
    response = operator_api.get(f"/api/v1/batches/{batch.pk}/export.xml")
    assert response.status_code == 404
    assert response.json() == {
        "error": "not_found",
        "detail": "No export format 'xml'; use csv, jsonl or zip.",
    }


def test_exports_over_the_per_process_limit_are_503(operator_api, settings):
    from batches.streaming import EXPORT_SLOTS

    settings.RECALL_EXPORTS_PER_PROCESS = 1
    batch = make_batch(1)
    held = operator_api.get(f"/api/v1/batches/{batch.pk}/export.csv")
    assert held.status_code == 200 and EXPORT_SLOTS.in_use == 1

    busy = operator_api.get(f"/api/v1/batches/{batch.pk}/export.csv")
    assert busy.status_code == 503
    assert busy["Retry-After"] == "30"
    assert busy.json()["error"] == "unavailable"
    held.close()
    assert EXPORT_SLOTS.in_use == 0
