"""Searching transcripts (jobs.search): what a search is, which items match on
each database, and what a hit shows (the excerpt, escaped, and the first
matching segment's start)."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from batches.models import BatchItem
from jobs import search as search_module
from jobs import transitions
from jobs.models import Job, JobStatus
from jobs.search import (
    INDEX_NAME,
    INDEXED_CHARS,
    MAX_SEARCH_CHARS,
    MAX_SEARCH_WORDS,
    BadSearch,
    Density,
    Search,
    TranscriptMatches,
    density_of,
    first_matching_segment,
    format_offset,
    in_batch_with_transcript,
    in_windows,
    parse_search,
    snippet,
    through_the_index,
    with_transcript,
)
from tests.support.factories import claim, later, make_batch, make_worker

BACKENDS = ("auto", "orm")  # PostgreSQL's statements (the ORM on SQLite), the ORM

# --- What a search is (pure) ---------------------------------------------------------


def test_a_search_is_its_words_lower_cased_each_once():
    search = parse_search("  Refund, REFUND the order #42_b  ")

    assert search == Search(
        "Refund, REFUND the order #42_b", ("refund", "the", "order", "42", "b")
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "Type a word"),
        ("   \t", "Type a word"),
        ("x" * (MAX_SEARCH_CHARS + 1), f"at most {MAX_SEARCH_CHARS} characters"),
        ("?! -- ...", "no word to look for"),
        ("refund\x00", "NUL"),
        (" ".join(f"w{n}" for n in range(MAX_SEARCH_WORDS + 1)), "at most 16 words"),
    ],
)
def test_a_search_that_cannot_run_says_why(value, message):
    with pytest.raises(BadSearch, match=message):
        parse_search(value)


def test_the_excerpt_escapes_the_transcript_and_marks_only_the_words():
    text = 'Hello <script>alert("x")</script> I want a Refund & <b>now</b>'

    html = snippet(text, parse_search("refund script"))

    assert html == (
        "Hello &lt;<mark>script</mark>&gt;alert(&quot;x&quot;)&lt;/<mark>script"
        "</mark>&gt; I want a <mark>Refund</mark> &amp; &lt;b&gt;now&lt;/b&gt;"
    )
    assert "<script>" not in html


def test_the_excerpt_is_around_the_first_word_found():
    text = " ".join(f"w{n}" for n in range(200)) + " refund " + "tail " * 100

    html = snippet(text, parse_search("refund"))

    assert html.startswith("…")
    assert html.endswith("…")
    assert "<mark>refund</mark>" in html
    assert len(html) < 300
    # Whole words: "refunded" is not "refund" (as PostgreSQL matches)...
    assert "<mark>" not in snippet("refunded", parse_search("refund"))
    # ... but it is on SQLite, whose match is by substring.
    assert snippet("refunded", parse_search("refund"), substrings=True) == (
        "<mark>refund</mark>ed"
    )


def test_the_first_matching_segment_gives_its_start():
    result = {
        "text": "hello there. about the refund. bye",
        "segments": [
            {"start": 0.0, "end": 2.0, "text": "hello there."},
            "not a segment",
            {"start": "soon", "end": 9, "text": "a refund without a time"},
            {"start": 65.4, "end": 70.0, "text": "about the Refund."},
            {"start": 80.0, "end": 81.0, "text": "refund again"},
        ],
    }

    assert first_matching_segment(result, parse_search("refund")) == 65.4
    assert first_matching_segment(result, parse_search("nothing")) is None
    assert first_matching_segment({"text": "refund"}, parse_search("refund")) is None
    assert first_matching_segment("junk", parse_search("refund")) is None
    assert [format_offset(s) for s in (0, 65.4, 3725)] == ["0:00", "1:05", "1:02:05"]


# --- Which items match ---------------------------------------------------------------


def _transcribe(batch, texts, *, at=1):
    """Claim and complete the batch's items in order with these transcripts."""
    worker = make_worker(f"gpu-{batch.pk}")
    for n, text in enumerate(texts):
        job = claim(worker, now=later(at + n))
        result = text if isinstance(text, dict) else {"text": text}
        transitions.complete(
            job, job.lease_token, worker=worker, result=result, now=later(at + n)
        )


def _ids(batch) -> list[int]:
    return list(
        BatchItem.objects.filter(batch=batch)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def _found(items) -> list[int]:
    return list(items.order_by("pk").values_list("pk", flat=True))


@pytest.mark.django_db
@pytest.mark.parametrize("backend", BACKENDS)
def test_items_are_found_by_every_word_of_their_transcript(backend, settings):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(3, name="calls")
    _transcribe(
        batch,
        [
            "The customer asked for a REFUND today",
            "no money back here",
            {"text": "refund policy explained", "segments": []},
        ],
    )
    other = make_batch(1, name="other")
    _transcribe(other, ["a refund in another batch"], at=10)
    ids = _ids(batch)

    def found(q: str) -> list[int]:
        return _found(in_batch_with_transcript(batch.pk, parse_search(q)))

    assert found("refund") == [ids[0], ids[2]]
    assert found("Refund policy") == [ids[2]]  # every word
    assert found("money back") == [ids[1]]
    assert found("absent") == []
    # Every batch's (the search page's scope).
    everywhere = _found(
        with_transcript(BatchItem.objects.all(), parse_search("refund"))
    )
    assert everywhere == [ids[0], ids[2], _ids(other)[0]]


@pytest.mark.django_db
def test_a_job_that_is_not_completed_is_not_found():
    batch = make_batch(2)
    _transcribe(batch, ["refund one"])
    # A job that leaves completed (as a re-run will send it back) is not found,
    # whatever its result still holds.
    Job.objects.filter(batch=batch, status=JobStatus.COMPLETED).update(
        status=JobStatus.CANCELLED
    )
    Job.objects.filter(batch=batch, status=JobStatus.QUEUED).update(
        result={"text": "refund two"}
    )

    assert _found(in_batch_with_transcript(batch.pk, parse_search("refund"))) == []


@pytest.mark.django_db
@pytest.mark.postgres
def test_on_postgresql_the_search_uses_the_full_text_index():
    batch = make_batch(2)
    _transcribe(batch, ["refund please", "nothing"])
    # The query's expression is the index's exactly (else PostgreSQL would
    # compute every transcript's vector instead).
    jobs = Job.objects.filter(status=JobStatus.COMPLETED).filter(
        TranscriptMatches("result", parse_search("refund"))
    )
    sql, params = jobs.values_list("pk").query.sql_with_params()

    with connection.cursor() as cursor:
        # With two jobs any index would do: leave the planner this one alone
        # (the test's transaction rolls the drop back).
        cursor.execute("DROP INDEX job_batch_status")
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())

    assert f"Bitmap Index Scan on {INDEX_NAME}" in plan, plan
    items = in_batch_with_transcript(batch.pk, parse_search("refund"))
    assert _found(items) == [_ids(batch)[0]]


@pytest.mark.django_db
@pytest.mark.postgres
def test_on_postgresql_the_index_is_partial_over_completed_jobs():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = %s", [INDEX_NAME]
        )
        (definition,) = cursor.fetchone()

    assert "USING gin" in definition
    assert "'simple'::regconfig" in definition
    assert f"{INDEXED_CHARS})" in definition
    assert "WHERE ((status)::text = 'completed'::text)" in definition


@pytest.mark.django_db
@pytest.mark.postgres
def test_on_postgresql_a_huge_transcript_completes_and_its_start_is_searchable():
    # Half a million distinct words: their vector would be several MB, over
    # PostgreSQL's 1 MB limit, and the completion would fail with it. Only the
    # first INDEXED_CHARS characters are indexed.
    text = "early " + " ".join(f"w{n:07}" for n in range(500_000)) + " late"
    batch = make_batch(1)
    _transcribe(batch, [text])

    assert Job.objects.get(batch=batch).status == JobStatus.COMPLETED
    assert _found(in_batch_with_transcript(batch.pk, parse_search("early"))) == _ids(
        batch
    )
    assert _found(in_batch_with_transcript(batch.pk, parse_search("late"))) == []


@pytest.mark.django_db
@pytest.mark.postgres
def test_on_postgresql_words_are_whole_and_any_language():
    batch = make_batch(3)
    _transcribe(batch, ["refunded", "Rückerstattung bitte", "返金 してください"])
    ids = _ids(batch)

    def found(q: str) -> list[int]:
        return _found(in_batch_with_transcript(batch.pk, parse_search(q)))

    assert found("refund") == []  # no stemming: the 'simple' configuration
    assert found("RÜCKERSTATTUNG") == [ids[1]]
    assert found("返金") == [ids[2]]


@pytest.mark.django_db
def test_on_sqlite_words_match_as_substrings():
    if connection.vendor == "postgresql":
        pytest.skip("SQLite's match")
    batch = make_batch(2)
    _transcribe(batch, ["refunded", "nothing"])

    found = _found(in_batch_with_transcript(batch.pk, parse_search("FUND")))

    assert found == [_ids(batch)[0]]


# --- A page a window of item ids at a time (PostgreSQL) ------------------------------

# "alpha" is sparse among the first items and in every item from 13 on; "beta"
# is in every transcript, "gamma" in one, "delta" in three far apart.
ALPHA = {1, *range(13, 24)}
DELTA = {0, 2, 20}


def _layout(n: int) -> str:
    words = ["beta"]
    if n in ALPHA:
        words.append("alpha")
    if n in DELTA:
        words.append("delta")
    if n == 22:
        words.append("gamma")
    return " ".join(words)


@pytest.fixture
def windowed(db, monkeypatch):
    """A batch of 24 transcribed items (ids consecutive), windows of 2 ids
    first; the batch's ids."""
    monkeypatch.setattr(search_module, "FIRST_WINDOW", 2)
    batch = make_batch(24, name="windows")
    _transcribe(batch, [_layout(n) for n in range(24)])
    ids = _ids(batch)
    assert ids == list(range(ids[0], ids[0] + 24))
    return batch, ids


WINDOW = re.compile(r'"batches_batchitem"\."id" BETWEEN (\d+) AND (\d+)')


def _windows(queries) -> list[str]:
    """The statements that read a window (not the statistics, nor a look for
    the nearest done item)."""
    return [
        q["sql"]
        for q in queries.captured_queries
        if WINDOW.search(q["sql"]) and "plainto_tsquery" in q["sql"]
    ]


def _read(batch, q: str, need: int, low: int, high: int, **kw) -> tuple[list, list]:
    """The items in_windows finds, and the windows it read (as offsets into
    the batch's ids)."""
    first = _ids(batch)[0]
    items = BatchItem.objects.filter(batch=batch)
    with CaptureQueriesContext(connection) as queries, through_the_index():
        found = in_windows(
            items, parse_search(q), need, first + low, first + high, **kw
        )
    windows = [
        (int(m[1]) - first, int(m[2]) - first)
        for sql in _windows(queries)
        if (m := WINDOW.search(sql))
    ]
    return [item.pk - first for item in found], windows


@pytest.mark.postgres
def test_a_page_widens_its_window_until_it_is_full(windowed):
    batch, _ = windowed

    # Sparse at the start, dense later (no statistics: 2 ids first). Each
    # next window at least twice as wide as the last, and as wide as the
    # density so far says the rest of the page needs: 1 match in 2 ids, 2 more
    # wanted, 5 ids (with the spare); then 1 in 7, 18 ids, to the end.
    assert _read(batch, "alpha", 3, 0, 23) == (
        [1, 13, 14],
        [(0, 1), (2, 6), (7, 23)],
    )
    # A word in every transcript: the first windows fill the page.
    assert _read(batch, "beta", 3, 0, 23) == ([0, 1, 2], [(0, 1), (2, 5)])
    # A cursor in the middle (after item 5): the windows begin after it. A
    # window with no match: the next one four times as wide.
    assert _read(batch, "alpha", 3, 6, 23) == ([13, 14, 15], [(6, 7), (8, 15)])
    # The last page: the range runs out before the page is full.
    assert _read(batch, "alpha", 5, 21, 23) == ([21, 22, 23], [(21, 22), (23, 23)])
    assert _read(batch, "gamma", 3, 0, 23) == ([22], [(0, 1), (2, 9), (10, 23)])
    assert _read(batch, "absent", 3, 0, 23) == ([], [(0, 1), (2, 9), (10, 23)])
    assert _read(batch, "alpha", 3, 5, 4) == ([], [])


@pytest.mark.postgres
def test_a_page_read_backwards_widens_its_window_down(windowed):
    batch, _ = windowed

    # None in 22-23: 8 ids; 1 match in 10 ids: 16, as many as the density
    # says (13) and at least twice the last.
    assert _read(batch, "delta", 2, 0, 23, descending=True) == (
        [20, 2],
        [(22, 23), (14, 21), (0, 13)],
    )
    assert _read(batch, "delta", 5, 0, 23, descending=True) == (
        [20, 2, 0],
        [(22, 23), (14, 21), (0, 13)],
    )
    assert _read(batch, "alpha", 4, 0, 19, descending=True) == (
        [19, 18, 17, 16],
        [(18, 19), (14, 17)],
    )


@pytest.mark.postgres
def test_pages_in_windows_are_the_pages_of_one_query(windowed):
    batch, ids = windowed
    items, search = BatchItem.objects.filter(batch=batch), parse_search("alpha")
    expected = [ids[n] for n in sorted(ALPHA)]

    for need in (1, 2, 3, 5, 12, 30):
        for low in range(0, 25):
            with through_the_index():
                up = in_windows(items, search, need, ids[0] + low, ids[-1])
                down = in_windows(
                    items, search, need, ids[0], ids[0] + low - 1, descending=True
                )
            assert [i.pk for i in up] == [pk for pk in expected if pk >= ids[0] + low][
                :need
            ]
            assert [i.pk for i in down] == [
                pk for pk in reversed(expected) if pk < ids[0] + low
            ][:need]


def _analyze() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "ANALYZE jobs_job"
        )  # its own rows too, in the test's transaction


@pytest.mark.postgres
def test_the_density_comes_from_the_statistics_of_the_index(windowed):
    assert density_of(parse_search("beta")) is None  # never analyzed
    _analyze()

    assert density_of(parse_search("beta")) == Density(1.0, 24.0, "", 1.0)
    # Words taken as independent; the key is the rarest word.
    both = density_of(parse_search("Alpha gamma"))
    assert both == Density(
        pytest.approx(0.5 / 24), 24.0, "gamma", pytest.approx(1 / 24)
    )
    # A word the statistics do not list: half the rarest listed one.
    absent = density_of(parse_search("beta absent"))
    assert absent == Density(
        pytest.approx(1 / 48), 24.0, "absent", pytest.approx(1 / 48)
    )


@pytest.mark.postgres
def test_a_window_of_a_common_word_tests_its_transcripts(windowed, monkeypatch):
    batch, _ = windowed
    _analyze()
    # 24 transcripts: testing 3 costs less than reading 24 entries only if a
    # test costs less than 8 entries.
    monkeypatch.setattr(search_module, "ENTRIES_PER_TEST", 7)

    with CaptureQueriesContext(connection) as queries:
        # The first window as wide as "beta" (in every transcript) needs.
        assert _read(batch, "beta", 3, 0, 23) == ([0, 1, 2], [(0, 3)])
    (window,) = _windows(queries)
    assert "ts_match_vq(" in window
    assert " @@ " not in window

    monkeypatch.setattr(search_module, "ENTRIES_PER_TEST", 8)
    with CaptureQueriesContext(connection) as queries:
        assert _read(batch, "beta", 3, 0, 23) == ([0, 1, 2], [(0, 3)])
    (window,) = _windows(queries)
    assert " @@ plainto_tsquery('simple'::regconfig, 'beta')" in window
    assert "ts_match_vq(" not in window


@pytest.mark.postgres
def test_a_window_of_several_words_reads_the_index_for_the_rarest(windowed):
    batch, _ = windowed
    _analyze()

    with CaptureQueriesContext(connection) as queries:
        # "alpha gamma": in 1 of 48 transcripts by the statistics: one window
        # of 60 ids, the whole batch.
        assert _read(batch, "alpha gamma", 3, 0, 23) == ([22], [(0, 23)])
    (window,) = _windows(queries)
    assert " @@ plainto_tsquery('simple'::regconfig, 'gamma')" in window
    assert "plainto_tsquery('simple'::regconfig, 'alpha gamma')" in window


@pytest.mark.postgres
def test_the_key_is_a_word_the_parser_gives_back_alone(db):
    # PostgreSQL reads "foo-bar" as "foo-bar", "foo" and "bar", and
    # "example.com" as that host alone: the key is a word every match has.
    batch = make_batch(4)
    _transcribe(
        batch,
        ["call foo-bar now", "bar then foo", "see example.com now", "example com"],
    )
    _analyze()
    ids = _ids(batch)
    items = BatchItem.objects.filter(batch=batch)

    def found(q: str) -> list[int]:
        search = parse_search(q)
        with through_the_index():
            windows = in_windows(items, search, 10, ids[0], ids[-1])
        everything = _found(with_transcript(items, search))
        assert [item.pk for item in windows] == everything
        return everything

    assert density_of(parse_search("foo-bar")).key in ("foo", "bar")
    assert found("foo-bar") == [ids[0]]
    assert found("foo-bar now") == [ids[0]]
    assert density_of(parse_search("example.com now")).key == "example.com"
    assert found("example.com now") == [ids[2]]
    assert found("example com") == [ids[3]]


@pytest.mark.postgres
def test_windows_skip_the_ids_of_items_not_done(db, monkeypatch):
    monkeypatch.setattr(search_module, "FIRST_WINDOW", 2)
    done = make_batch(10, name="done")
    _transcribe(done, ["alpha" if n in (3, 7) else "beta" for n in range(10)])
    make_batch(20, name="queued")  # newer ids, no transcript yet
    ids = list(BatchItem.objects.order_by("pk").values_list("pk", flat=True))
    assert ids == list(range(ids[0], ids[0] + 30))
    first = ids[0]
    items = BatchItem.objects.all()

    def read(need, low, high, **kw):
        with CaptureQueriesContext(connection) as queries, through_the_index():
            found = in_windows(
                items, parse_search("alpha"), need, first + low, first + high, **kw
            )
        windows = [WINDOW.search(sql) for sql in _windows(queries)]
        return (
            [item.pk - first for item in found],
            [(int(m[1]) - first, int(m[2]) - first) for m in windows],
        )

    # Newest first: nothing in 28-29, so on from the nearest done item (9),
    # four times as wide.
    assert read(2, 0, 29, descending=True) == ([7, 3], [(28, 29), (2, 9)])
    # After the last done item: one window, and no done item beyond it.
    assert read(2, 10, 29) == ([], [(10, 11)])
    # 2 matches in 10 ids, 3 more wanted: 19 ids; then no done item is left.
    assert read(5, 0, 29) == ([3, 7], [(0, 1), (2, 9), (10, 28)])
