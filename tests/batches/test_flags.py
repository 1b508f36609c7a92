"""Quality flags: the rules, how a completion stores them on both backends, the
counters a recount agrees with, and the surfaces that show and filter them."""

from __future__ import annotations

import csv
import io
import json

import pytest
from django.contrib.auth.models import User
from django.test import Client

from batches.flags import FLAGS, UnknownFlag, flags_for, parse_flag
from batches.models import BatchCounter, BatchItem
from engine.progress import progress_for
from jobs import transitions
from jobs.models import Job
from tests.support.clients import ApiClient, token_for
from tests.support.factories import (
    assert_consistent,
    claim,
    later,
    make_batch,
    make_user,
    make_worker,
)

# --- The rules (pure) ------------------------------------------------------------


def words(n: int) -> dict:
    return {"text": " ".join(["word"] * n)}


@pytest.mark.parametrize(
    ("result", "duration_ms", "language", "expected"),
    [
        ({"text": ""}, None, None, ("empty",)),
        ({"text": "  \n\t "}, None, None, ("empty",)),
        ({"text": ["not", "text"]}, None, None, ("empty",)),
        ({}, None, None, ("empty",)),
        (words(1), None, None, ()),
        # Unknown duration: never short, however few the words.
        (words(1), None, "en", ()),
        # Under 30 s: never short.
        (words(0), 29_999, None, ("empty",)),
        (words(1), 29_999, None, ()),
        # At 30 s with 20 words per minute: fewer than 10 words is short.
        (words(9), 30_000, None, ("short",)),
        (words(10), 30_000, None, ()),
        (words(0), 30_000, None, ("empty", "short")),
        # One minute: 19 short, 20 not (fewer than, not at most).
        (words(19), 60_000, None, ("short",)),
        (words(20), 60_000, None, ()),
        # Languages: both given and different (case and spaces ignored).
        ({"text": "hallo", "language": "de"}, None, "en", ("language_mismatch",)),
        ({"text": "hello", "language": "EN "}, None, "en", ()),
        ({"text": "hello", "language": "de"}, None, None, ()),
        ({"text": "hello", "language": "de"}, None, "", ()),
        ({"text": "hello", "language": "de"}, None, 7, ()),
        ({"text": "hello"}, None, "en", ()),
        ({"text": "hello", "language": ""}, None, "en", ()),
        (
            {"text": "", "language": "fr"},
            120_000,
            "en",
            ("empty", "language_mismatch", "short"),
        ),
    ],
)
def test_flag_rules(result, duration_ms, language, expected):
    assert flags_for(result, duration_ms=duration_ms, language=language) == expected


def test_the_words_per_minute_are_a_setting(settings):
    settings.RECALL_MIN_WORDS_PER_MINUTE = 60
    assert flags_for(words(59), duration_ms=60_000, language=None) == ("short",)
    assert flags_for(words(60), duration_ms=60_000, language=None) == ()
    settings.RECALL_MIN_WORDS_PER_MINUTE = 0
    assert flags_for(words(0), duration_ms=600_000, language=None) == ("empty",)


def test_an_unknown_flag_is_refused_by_name():
    assert parse_flag("short") == "short"
    with pytest.raises(UnknownFlag, match="one of empty, short, language_mismatch"):
        parse_flag("long")


# --- Completions store them, on both backends -------------------------------------

BACKENDS = ("auto", "orm")  # PostgreSQL's statements (the ORM on SQLite), the ORM


def _complete_all(batch, results, worker, *, at=1):
    """Claim and complete every item of ``batch`` in order with ``results``."""
    for n, result in enumerate(results):
        job = claim(worker, now=later(at + n))
        transitions.complete(
            job, job.lease_token, worker=worker, result=result, now=later(at + n)
        )


def _flagged(batch) -> list[list[str]]:
    return [item.flags for item in BatchItem.objects.filter(batch=batch).order_by("pk")]


def _flag_totals(batch) -> dict[str, int]:
    totals = BatchCounter.objects.filter(batch=batch).totals()
    return {flag: totals[f"flag_{flag}"] for flag in FLAGS}


@pytest.fixture
def flagged_batch(db):
    """Five items completed: empty, short, mismatched, fine, all three."""
    batch = make_batch(
        durations=[10, 60, 5, 60, 60],
        languages=["en", "en", "en", "", "en"],
        name="calls",
    )
    worker = make_worker("gpu-flags")
    _complete_all(
        batch,
        [
            {"text": ""},
            {"text": "only a few words here"},
            {"text": "hallo welt", "language": "de"},
            {"text": " ".join(["w"] * 25), "language": "de"},
            {"text": "", "language": "fr"},
        ],
        worker,
    )
    return batch


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_completion_stores_its_flags_and_counts_them(backend, settings):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(
        durations=[10, 60, 5, 60, 60, None],
        languages=["en", "en", "en", "", "en", "en"],
    )
    worker = make_worker()
    _complete_all(
        batch,
        [
            {"text": ""},
            {"text": "only a few words here"},
            {"text": "hallo welt", "language": "de"},
            {"text": " ".join(["w"] * 25), "language": "de"},
            {"text": "", "language": "fr"},
            {"text": "hi", "language": "en"},
        ],
        worker,
    )

    assert _flagged(batch) == [
        ["empty"],
        ["short"],
        ["language_mismatch"],
        [],
        ["empty", "language_mismatch", "short"],
        [],
    ]
    assert _flag_totals(batch) == {"empty": 2, "short": 2, "language_mismatch": 2}
    assert progress_for(batch, now=later(60)).as_json()["flags"] == {
        "empty": 2,
        "short": 2,
        "language_mismatch": 2,
    }
    # The counters equal a fresh count: a recount finds nothing to fix.
    assert transitions.recount(batch.pk, now=later(60)) is False
    assert_consistent(later(60))


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replayed_completion_keeps_the_first_flags(backend, settings):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(durations=[60])
    worker = make_worker()
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": ""}, now=later(1)
    )
    transitions.complete(
        job, job.lease_token, worker=worker, result=words(100), now=later(2)
    )

    assert _flagged(batch) == [["empty", "short"]]
    assert _flag_totals(batch) == {"empty": 1, "short": 1, "language_mismatch": 0}


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_items_not_completed_have_no_flags(backend, settings):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(durations=[60, 60, 60])
    worker = make_worker()
    failed = claim(worker)
    transitions.fail(
        failed, failed.lease_token, worker=worker, error="x", retryable=False
    )
    claim(worker)  # in flight
    # queued: the third

    assert _flagged(batch) == [[], [], []]
    assert _flag_totals(batch) == dict.fromkeys(FLAGS, 0)
    assert_consistent(later(0))


@pytest.mark.django_db
def test_an_item_that_leaves_done_loses_its_flags_and_the_counts_follow():
    # No transition sends a done item back yet (re-running will): the rows
    # layer clears its flags with the move, so the counters stay a recount.
    from jobs.transitions.rows import move_jobs

    batch = make_batch(durations=[60])
    worker = make_worker()
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": ""}, now=later(1)
    )
    job = Job.objects.select_related("item").get(pk=job.pk)
    move_jobs([job], to="queued", now=later(2))

    assert _flagged(batch) == [[]]
    assert _flag_totals(batch) == dict.fromkeys(FLAGS, 0)
    assert transitions.recount(batch.pk, now=later(3)) is False


@pytest.mark.django_db
def test_a_recount_heals_drifted_flag_counters(flagged_batch):
    BatchCounter.objects.filter(batch=flagged_batch).update(flag_short=7, flag_empty=0)
    from engine.checks import find_violations

    assert [v.check for v in find_violations(now=later(60))] == ["counters-match-items"]

    assert transitions.recount(flagged_batch.pk, now=later(60)) is True

    assert _flag_totals(flagged_batch) == {
        "empty": 2,
        "short": 2,
        "language_mismatch": 2,
    }
    assert transitions.recount(flagged_batch.pk, now=later(61)) is False
    assert_consistent(later(61))


@pytest.mark.django_db
def test_the_invariant_check_finds_flags_on_an_item_not_done(flagged_batch):
    from engine.checks import find_violations

    item = BatchItem.objects.filter(batch=flagged_batch).order_by("pk").first()
    BatchItem.objects.filter(pk=item.pk).update(status="failed")

    found = [
        v.detail
        for v in find_violations(now=later(60))
        if v.check == "flags-only-on-done"
    ]
    assert found == [f"item {item.pk} is failed but has quality flags"]


# --- Surfaces ---------------------------------------------------------------------


@pytest.fixture
def viewer_api(db) -> ApiClient:
    return ApiClient(token_for(make_user("flag-viewer", "Viewers")))


@pytest.mark.django_db
def test_the_operator_api_shows_and_filters_flags(flagged_batch, viewer_api):
    base = f"/api/v1/batches/{flagged_batch.pk}"
    ids = list(
        BatchItem.objects.filter(batch=flagged_batch)
        .order_by("pk")
        .values_list("pk", flat=True)
    )

    detail = viewer_api.get(base).json()
    assert detail["flags"] == {"empty": 2, "short": 2, "language_mismatch": 2}
    items = viewer_api.get(f"{base}/items").json()["items"]
    assert [(i["id"], i["flags"]) for i in items] == [
        (ids[0], ["empty"]),
        (ids[1], ["short"]),
        (ids[2], ["language_mismatch"]),
        (ids[3], []),
        (ids[4], ["empty", "language_mismatch", "short"]),
    ]
    for flag, expected in [
        ("empty", [ids[0], ids[4]]),
        ("short", [ids[1], ids[4]]),
        ("language_mismatch", [ids[2], ids[4]]),
    ]:
        page = viewer_api.get(f"{base}/items", flag=flag).json()
        assert [i["id"] for i in page["items"]] == expected
    # Combined with the state filter and the cursor.
    page = viewer_api.get(f"{base}/items", flag="short", state="done", limit=1).json()
    assert [i["id"] for i in page["items"]] == [ids[1]]
    rest = viewer_api.get(
        f"{base}/items", flag="short", cursor=page["next_cursor"]
    ).json()
    assert ([i["id"] for i in rest["items"]], rest["next_cursor"]) == ([ids[4]], None)
    assert viewer_api.get(f"{base}/items", flag="short", state="failed").json() == {
        "items": [],
        "next_cursor": None,
    }


@pytest.mark.django_db
def test_an_unknown_flag_filter_is_400(flagged_batch, viewer_api):
    response = viewer_api.get(f"/api/v1/batches/{flagged_batch.pk}/items", flag="long")

    assert response.status_code == 400
    assert response.json() == {
        "error": "bad_request",
        "detail": "'flag' must be one of empty, short, language_mismatch.",
    }


@pytest.mark.django_db
def test_progress_json_carries_the_flag_counts(flagged_batch):
    client = Client()
    client.force_login(make_user("flag-page-viewer", "Viewers"))

    body = client.get(f"/batches/{flagged_batch.pk}/progress.json").json()

    assert body["flags"] == {"empty": 2, "short": 2, "language_mismatch": 2}


def _export(batch, fmt: str) -> str:
    client = Client()
    client.force_login(
        User.objects.filter(username="flag-exporter").first()
        or make_user("flag-exporter", "Operators")
    )
    response = client.get(f"/batches/{batch.pk}/export.{fmt}")
    assert response.status_code == 200
    return b"".join(response.streaming_content).decode()


@pytest.mark.django_db
def test_exports_carry_the_flags(flagged_batch):
    rows = list(csv.reader(io.StringIO(_export(flagged_batch, "csv"))))
    assert rows[0][-1] == "flags"
    assert [row[-1] for row in rows[1:]] == [
        "empty",
        "short",
        "language_mismatch",
        "",
        "empty language_mismatch short",
    ]

    records = [
        json.loads(line) for line in _export(flagged_batch, "jsonl").splitlines()
    ]
    assert [r["flags"] for r in records] == [
        ["empty"],
        ["short"],
        ["language_mismatch"],
        [],
        ["empty", "language_mismatch", "short"],
    ]


@pytest.mark.django_db
def test_the_batch_page_shows_the_counts_and_filters_by_flag(flagged_batch):
    client = Client()
    client.force_login(make_user("flag-page-reader", "Viewers"))
    ids = list(
        BatchItem.objects.filter(batch=flagged_batch)
        .order_by("pk")
        .values_list("pk", flat=True)
    )

    page = client.get(f"/batches/{flagged_batch.pk}/").content.decode()
    for flag in FLAGS:
        assert f'<strong data-flag-count="{flag}">2</strong>' in page

    short = client.get(f"/batches/{flagged_batch.pk}/", {"flag": "short"})
    listed = [item.pk for item in short.context["page"].object_list]
    assert listed == [ids[1], ids[4]]
    assert short.context["page"].count == 2
    none = client.get(
        f"/batches/{flagged_batch.pk}/", {"flag": "short", "state": "failed"}
    )
    assert list(none.context["page"].object_list) == []

    item = client.get(f"/items/{ids[4]}/").content.decode()
    assert 'data-flag="empty"' in item
    assert 'data-flag="language_mismatch"' in item
    assert 'data-flag="short"' in item


# --- The demo's flagged transcripts ------------------------------------------------


def test_the_demo_manifests_items_come_out_flagged(settings):
    """``make demo`` (scripts/demo.py FLAGGED) asks the simulated engine for a
    silent, a mumbled and a German item: each yields its flag, the rest none."""
    from tests.support.worker import load_worker_module

    rw = load_worker_module()

    def flags(quirk, seconds, asked="en"):
        result = rw.simulated_transcript(8, seconds, quirk)
        return flags_for(result, duration_ms=int(seconds * 1000), language=asked)

    assert flags("silence", 45.0) == ("empty", "short")
    assert flags("mumble", 90.0) == ("short",)
    assert flags("", 45.0, asked="de") == ("language_mismatch",)
    assert flags(None, 20.0) == ()
    assert flags(None, 3600.0) == ()


@pytest.mark.django_db
@pytest.mark.postgres
def test_on_postgresql_a_flagged_completion_is_one_statement():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    batch = make_batch(durations=[60, 60, 60], languages=["en", "en", "en"])
    worker = make_worker()
    job = claim(worker)

    with CaptureQueriesContext(connection) as captured:
        transitions.complete(
            job,
            job.lease_token,
            worker=worker,
            result={"text": "", "language": "de"},
            now=later(1),
        )

    # The completion decides its flags from the item it locks, in the
    # backend's prepared statement (run on psycopg's own cursor, not captured
    # here): no ORM query reads the item first or writes after it on the clean
    # path, so completions cost what they did before flags.
    queries = [q["sql"] for q in captured if "SAVEPOINT" not in q["sql"]]
    assert queries == []
    assert _flagged(batch)[0] == ["empty", "language_mismatch", "short"]
    assert _flag_totals(batch) == {"empty": 1, "short": 1, "language_mismatch": 1}


@pytest.mark.django_db
def test_the_admin_lists_and_filters_items_by_flag(flagged_batch):
    client = Client()
    client.force_login(make_user("flag-admin", superuser=True))
    ids = list(
        BatchItem.objects.filter(batch=flagged_batch)
        .order_by("pk")
        .values_list("pk", flat=True)
    )

    response = client.get("/admin/batches/batchitem/", {"flag_short__exact": "1"})

    assert response.status_code == 200
    listed = sorted(item.pk for item in response.context["cl"].result_list)
    assert listed == [ids[1], ids[4]]
    assert "empty, language_mismatch, short" in response.content.decode()
