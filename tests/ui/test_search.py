"""The search page (/search/) and the batch page's search box: words in the
transcripts of the batches a user may view, excerpts escaped and marked, the
first matching segment's start, paging, and bad searches as form errors."""

from __future__ import annotations

import pytest

from batches.models import BatchItem
from console.views import search as search_view
from jobs import search as search_module
from jobs import transitions
from tests.support.clients import client_for
from tests.support.factories import claim, later, make_batch, make_user, make_worker

pytestmark = pytest.mark.django_db


def _transcribe(batch, results, *, at=1):
    worker = make_worker(f"gpu-{batch.pk}")
    for n, result in enumerate(results):
        job = claim(worker, now=later(at + n))
        transitions.complete(
            job, job.lease_token, worker=worker, result=result, now=later(at + n)
        )


def _ids(batch) -> list[int]:
    return list(
        BatchItem.objects.filter(batch=batch)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


@pytest.fixture
def calls(db):
    """Two batches with transcripts, one hostile, one with timed segments."""
    first = make_batch(3, name="Monday calls")
    _transcribe(
        first,
        [
            {"text": "I want a refund <script>alert(1)</script> now"},
            {"text": "nothing to see"},
            {
                "text": "hello. the refund is on its way. bye",
                "segments": [
                    {"start": 0.0, "end": 2.0, "text": "hello."},
                    {"start": 65.0, "end": 70.0, "text": "the refund is on its way."},
                    {"start": 70.0, "end": 71.0, "text": "bye"},
                ],
            },
        ],
    )
    second = make_batch(1, name="Tuesday <calls>")
    _transcribe(second, [{"text": "refund again"}], at=10)
    return first, second


def test_the_search_page_finds_transcripts_in_every_batch(calls, viewer):
    first, second = calls
    client = client_for(viewer)

    response = client.get("/search/", {"q": "REFUND"})

    assert response.status_code == 200
    hits = response.context["hits"]
    # Newest item first.
    assert [h.item.pk for h in hits] == [
        _ids(second)[0],
        _ids(first)[2],
        _ids(first)[0],
    ]
    page = response.content.decode()
    assert "Monday calls" in page
    assert "Tuesday &lt;calls&gt;" in page
    assert f'href="/items/{_ids(first)[0]}/"' in page
    assert f'href="/batches/{second.pk}/"' in page
    # The hostile transcript is shown escaped, the word marked.
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>alert(1)" not in page
    assert "<mark>refund</mark>" in page
    # The timed transcript: where the first segment with the word starts.
    assert [h.start_text for h in hits] == ["", "1:05", ""]
    assert "at 1:05" in page


def test_the_search_page_is_in_the_navigation(viewer):
    page = client_for(viewer).get("/").content.decode()

    assert 'href="/search/"' in page


def test_the_search_page_asks_a_login_and_the_batches_view_permission(calls, client):
    anonymous = client.get("/search/", {"q": "refund"})
    assert anonymous.status_code == 302
    assert anonymous["Location"].startswith("/accounts/login/")

    stranger = client_for(make_user("nobody-in-particular"))
    assert stranger.get("/search/", {"q": "refund"}).status_code == 403


@pytest.mark.parametrize(
    ("q", "message"),
    [
        ("", "Type a word to search for."),
        ("   ", "Type a word to search for."),
        ("x" * 201, "at most 200 characters"),
        ("?!", "no word to look for"),
        ("a\x00b", "Null characters are not allowed."),
    ],
)
def test_a_bad_search_is_a_form_error(calls, viewer, q, message):
    response = client_for(viewer).get("/search/", {"q": q})

    assert response.status_code == 400
    assert message in response.content.decode()
    assert "hits" not in response.context


def test_the_search_page_without_a_search_is_the_form(viewer):
    response = client_for(viewer).get("/search/")

    assert response.status_code == 200
    assert 'name="q"' in response.content.decode()
    assert 'role="alert"' not in response.content.decode()


def test_the_search_page_pages_by_keyset(calls, viewer, monkeypatch):
    monkeypatch.setattr(search_view, "HITS_PER_PAGE", 2)
    first, second = calls
    client = client_for(viewer)

    one = client.get("/search/", {"q": "refund"})
    assert [h.item.pk for h in one.context["hits"]] == [_ids(second)[0], _ids(first)[2]]
    assert one.context["newer"] is None
    older = one.context["older"]
    assert older == _ids(first)[2]

    two = client.get("/search/", {"q": "refund", "older": older})
    assert [h.item.pk for h in two.context["hits"]] == [_ids(first)[0]]
    assert two.context["older"] is None
    assert two.context["newer"] == _ids(first)[0]

    back = client.get("/search/", {"q": "refund", "newer": two.context["newer"]})
    assert [h.item.pk for h in back.context["hits"]] == [
        _ids(second)[0],
        _ids(first)[2],
    ]
    assert back.context["newer"] is None


def test_the_batch_page_finds_items_by_transcript_or_source(calls, viewer):
    first, _ = calls
    client = client_for(viewer)
    ids = _ids(first)

    def listed(q: str) -> list[int]:
        response = client.get(f"/batches/{first.pk}/", {"q": q})
        assert response.status_code == 200
        return [item.pk for item in response.context["page"].object_list]

    # Words of the transcripts, in this batch only.
    assert listed("refund") == [ids[0], ids[2]]
    # The source, as before (make_batch names them file:///audio/<name>-<i>.wav).
    assert listed("calls-1.wav") == [ids[1]]
    assert listed("see") == [ids[1]]
    assert listed("Monday") == ids  # every source has the batch's name in it


def test_the_batch_page_search_pages_merge_sources_and_transcripts(viewer, monkeypatch):
    from console.views import batches as batch_views

    monkeypatch.setattr(batch_views, "ITEMS_PER_PAGE", 2)
    batch = make_batch(5, name="mix")
    _transcribe(
        batch, [{"text": "x"}, {"text": "alpha"}, {"text": "y"}, {"text": "alpha"}]
    )
    ids = _ids(batch)
    client = client_for(viewer)

    # Item 0's source is ".../mix-0.wav": "mix-0" matches it; "alpha" items 1, 3.
    one = client.get(f"/batches/{batch.pk}/", {"q": "alpha"})
    assert [i.pk for i in one.context["page"].object_list] == [ids[1], ids[3]]
    assert one.context["page"].at_end

    first = client.get(f"/batches/{batch.pk}/", {"q": "mix"})
    page = first.context["page"]
    assert [i.pk for i in page.object_list] == ids[:2]
    second = client.get(f"/batches/{batch.pk}/", {"q": "mix", "after": page.older})
    assert [i.pk for i in second.context["page"].object_list] == ids[2:4]


@pytest.mark.postgres
def test_the_search_page_pages_through_widening_windows(viewer, monkeypatch):
    # PostgreSQL reads a page a window of item ids at a time, newest first
    # (jobs.search.in_windows): 2 ids first here, each next window twice as wide.
    monkeypatch.setattr(search_module, "FIRST_WINDOW", 2)
    monkeypatch.setattr(search_view, "HITS_PER_PAGE", 2)
    early = make_batch(24, name="early")
    _transcribe(
        early, [{"text": "delta" if n in (0, 2, 20) else "beta"} for n in range(24)]
    )
    late = make_batch(3, name="late")
    _transcribe(late, [{"text": t} for t in ("beta", "delta", "beta")], at=30)
    ids = _ids(early) + _ids(late)
    assert ids == list(range(ids[0], ids[0] + 27))
    client = client_for(viewer)

    def page(**cursor) -> tuple[list[int], int | None, int | None]:
        params = {"q": "delta"} | {k: ids[v] for k, v in cursor.items()}
        context = client.get("/search/", params).context
        found = [ids.index(hit.item.pk) for hit in context["hits"]]
        older, newer = context["older"], context["newer"]
        return (
            found,
            None if older is None else ids.index(older),
            None if newer is None else ids.index(newer),
        )

    # Newest first, across both batches: windows 25-26, 21-24, 13-20 (full
    # once item 2 is found in 0-12).
    assert page() == ([25, 20], 20, None)
    # The last page: windows 18-19, 14-17, 6-13, 0-5 (the ids run out).
    assert page(older=20) == ([2, 0], None, 2)
    # Back: windows 3-4, 5-8, 9-16, 17-26 (the ids run out).
    assert page(newer=2) == ([25, 20], 20, None)
    # A cursor in the middle, on an item without the word.
    assert page(older=10) == ([2, 0], None, 2)
    assert page(newer=10) == ([25, 20], 20, None)
    assert page(newer=26) == ([], None, None)
