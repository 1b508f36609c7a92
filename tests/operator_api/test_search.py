"""The Operator API's item search: ``GET /api/v1/batches/<id>/items?q=WORDS``,
combined with the state and flag filters and the keyset cursor; a bad search
is a 400 in JSON."""

from __future__ import annotations

import pytest

from batches.models import BatchItem
from jobs import search as search_module
from jobs import transitions
from tests.support.factories import claim, later, make_batch, make_worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def batch(db):
    """Six items: five transcribed (one empty), one queued; and another batch
    whose transcript has the word too."""
    worker = make_worker("gpu-api-search")
    make_batch(1, name="elsewhere")
    job = claim(worker, now=later(0))
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "refund"}, now=later(0)
    )
    batch = make_batch(durations=[60, 60, 10, 60, 60, 60], name="api-calls")
    for n, text in enumerate(
        ["refund please", "", "a REFUND, twice: refund", "no", "refund"], start=1
    ):
        job = claim(worker, now=later(n))
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": text}, now=later(n)
        )
    return batch


def _ids(batch) -> list[int]:
    return list(
        BatchItem.objects.filter(batch=batch)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def test_q_finds_items_by_the_words_of_their_transcript(batch, viewer_api):
    ids = _ids(batch)

    response = viewer_api.get(f"/api/v1/batches/{batch.pk}/items", q="Refund")

    assert response.status_code == 200
    body = response.json()
    assert [i["id"] for i in body["items"]] == [ids[0], ids[2], ids[4]]
    assert body["items"][1]["result"] == {"text": "a REFUND, twice: refund"}
    assert body["next_cursor"] is None


def test_q_combines_with_the_filters_and_the_cursor(batch, viewer_api):
    ids = _ids(batch)
    path = f"/api/v1/batches/{batch.pk}/items"

    first = viewer_api.get(path, q="refund", limit=2).json()
    assert [i["id"] for i in first["items"]] == [ids[0], ids[2]]
    second = viewer_api.get(path, q="refund", limit=2, cursor=first["next_cursor"])
    assert [i["id"] for i in second.json()["items"]] == [ids[4]]
    assert second.json()["next_cursor"] is None

    done = viewer_api.get(path, q="refund", state="done").json()
    assert [i["id"] for i in done["items"]] == [ids[0], ids[2], ids[4]]
    queued = viewer_api.get(path, q="refund", state="queued").json()
    assert queued["items"] == []
    # Items 0 and 4 are short (two words or one in a minute); item 2 is too
    # short a recording to be.
    short = viewer_api.get(path, q="refund", flag="short").json()
    assert [i["id"] for i in short["items"]] == [ids[0], ids[4]]


@pytest.mark.parametrize(
    ("q", "detail"),
    [
        ("", "Type a word"),
        ("  ", "Type a word"),
        ("x" * 201, "at most 200 characters"),
        ("!!", "no word to look for"),
        ("a\x00b", "NUL"),
        (" ".join(f"w{n}" for n in range(17)), "at most 16 words"),
    ],
)
def test_a_bad_q_is_a_400(batch, viewer_api, q, detail):
    response = viewer_api.get(f"/api/v1/batches/{batch.pk}/items", q=q)

    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "bad_request"
    assert detail in body["detail"]
    assert body["detail"].startswith("'q': ")


def test_q_needs_the_view_permission(batch, stranger_api):
    response = stranger_api.get(f"/api/v1/batches/{batch.pk}/items", q="refund")

    assert response.status_code == 403


@pytest.mark.postgres
def test_q_pages_through_widening_windows_of_the_batch(viewer_api, monkeypatch):
    # PostgreSQL reads a page a window of item ids at a time (jobs.search.
    # in_windows): 2 ids first here, each next window twice as wide.
    monkeypatch.setattr(search_module, "FIRST_WINDOW", 2)
    worker = make_worker("gpu-windows")
    batch = make_batch(24, name="windows")
    # "alpha" in item 1, then in every item from 13 on: sparse, then dense.
    for n in range(24):
        job = claim(worker, now=later(n))
        text = "alpha" if n == 1 or n >= 13 else "beta"
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": text}, now=later(n)
        )
    after = make_batch(1, name="after")  # its transcript has the word too
    job = claim(worker, now=later(30))
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "alpha"}, now=later(30)
    )
    ids = _ids(batch)
    path = f"/api/v1/batches/{batch.pk}/items"

    def page(cursor=None, **params) -> tuple[list[int], int | None]:
        if cursor is not None:
            params["cursor"] = ids[cursor]
        body = viewer_api.get(path, q="alpha", limit=3, **params).json()
        cursor = body["next_cursor"]
        found = [ids.index(item["id"]) for item in body["items"]]
        return found, None if cursor is None else ids.index(int(cursor))

    # The first page spans four windows: 0-1, 2-5, 6-13, 14-23.
    assert page() == ([1, 13, 14], 14)
    assert page(14) == ([15, 16, 17], 17)
    assert page(17) == ([18, 19, 20], 20)
    # The last page: the batch's ids run out (the next batch's item is not
    # the batch's, though its id is next).
    assert page(20) == ([21, 22, 23], None)
    # A cursor in the middle, on an item without the word.
    assert page(5) == ([13, 14, 15], 15)
    assert page(23) == ([], None)
    # With a filter: the windows hold the matches, the filter picks.
    assert page(state="done") == ([1, 13, 14], 14)
    assert page(state="queued") == ([], None)
    assert _ids(after)[0] == ids[-1] + 1
