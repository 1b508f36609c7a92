"""Searching transcripts: the words of a search, the filter that matches them,
and the excerpt shown for each hit. Read-only.

A transcript is the ``text`` of a completed job's result. On PostgreSQL the
match is full-text: a GIN index over
``to_tsvector('simple', left(result->>'text', INDEXED_CHARS))`` of the
completed jobs (migration ``jobs.0018_transcript_search``), queried with
``plainto_tsquery('simple', <search>)``: every word of the search, whole,
ignoring case. The ``simple`` configuration lower-cases words and nothing
else (no stemming, no stop words), so it assumes no language: a batch of
German calls is searched as well as one of English ones, and "refund" does
not find "refunded". Only the first ``INDEXED_CHARS`` characters of a
transcript are indexed, because PostgreSQL refuses a text-search vector of
more than 1 MB, and a completion whose transcript produced one would fail.

Because the index is an expression over the job's own row, nothing writes
it but PostgreSQL: a completion indexes its transcript in its own
transaction, a job that leaves ``completed`` (a retry, a re-run, a requeue)
leaves the index with it, and a purged job takes its entry along.

On SQLite (the embedded default) there is no index: the match is a scan of
the batch's transcripts for every word as a substring (``LIKE``, so case is
ignored for ASCII letters only), "fund" finding "refund" too.

Pages are never counted or ranked: hits come in item order, a page at a time,
after a keyset cursor. On PostgreSQL a page is read a window of item ids at a
time (``in_windows``), through the index (the word's entries ANDed with the
window's items) or by testing the window's transcripts, whichever the index's
statistics say costs less, the windows widening until the page is full or the
ids run out: a word in every transcript costs about a page, not a sort of all
its matches, and a word in none a few look-ups of the index.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from math import ceil
from typing import Any

from django.db import connection, transaction
from django.db.models import BooleanField, F, Func, Max, Min, QuerySet
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from batches.models import BatchItem, ItemStatus

from .models import Job, JobStatus

# The text-search configuration: lower-cases, no stemming, no stop words.
SEARCH_CONFIG = "simple"
# Characters of a transcript the index holds (see the module docstring): a
# vector holds each distinct word once, so 100,000 characters of the most
# hostile text stay under PostgreSQL's 1 MB limit.
INDEXED_CHARS = 100_000
INDEX_NAME = "job_transcript_search"
MAX_SEARCH_CHARS = 200
MAX_SEARCH_WORDS = 16
# A word: letters and digits (not "_", which PostgreSQL's parser splits on).
WORD = re.compile(r"[^\W_]+")


def transcript_vector_sql(result: str) -> str:
    """The indexed expression over a job's ``result`` column (SQL): the query
    must write it exactly so for PostgreSQL to use the index."""
    return (
        f"to_tsvector('{SEARCH_CONFIG}'::regconfig, "
        f"left(COALESCE(({result} ->> 'text'), ''), {INDEXED_CHARS}))"
    )


class BadSearch(ValueError):
    """A search that cannot run: empty, too long, no words, a NUL."""


@dataclass(frozen=True)
class Search:
    """A search as typed (stripped) and its words, lower-cased, each once."""

    text: str
    words: tuple[str, ...]


def parse_search(value: str) -> Search:
    """The search ``value`` asks for; BadSearch says what is wrong with it."""
    if "\x00" in value:
        raise BadSearch("The search must not contain NUL characters.")
    text = value.strip()
    if not text:
        raise BadSearch("Type a word to search for.")
    if len(text) > MAX_SEARCH_CHARS:
        raise BadSearch(
            f"The search must be at most {MAX_SEARCH_CHARS} characters "
            f"(it has {len(text)})."
        )
    words = tuple(dict.fromkeys(w.lower() for w in WORD.findall(text)))
    if not words:
        raise BadSearch("The search has no word to look for (letters or digits).")
    if len(words) > MAX_SEARCH_WORDS:
        raise BadSearch(f"The search must have at most {MAX_SEARCH_WORDS} words.")
    return Search(text, words)


class TranscriptMatches(Func):
    """True where the result (a job's ``result`` column) has a transcript with
    every word of the search: full-text on PostgreSQL, substrings elsewhere."""

    output_field = BooleanField()

    def __init__(
        self, result: str, search: Search, *, indexed: bool = True, key: str = ""
    ) -> None:
        super().__init__(F(result))
        self.search = search
        self.indexed = indexed
        self.key = key

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        sql, params = compiler.compile(self.source_expressions[0])
        vector = transcript_vector_sql(sql)
        query = f"plainto_tsquery('{SEARCH_CONFIG}'::regconfig, %s)"
        # Not indexed: the function behind @@, the same match, which PostgreSQL
        # cannot answer from the index, so it tests each transcript it reads.
        test = f"ts_match_vq({vector}, {query})"
        if not self.indexed:
            return test, (*params, self.search.text)
        if self.key:
            # The index for the key (one word of the search) alone, the search
            # tested on what it finds (``Density``).
            return (
                f"({vector} @@ {query} AND {test})",
                (*params, self.key, *params, self.search.text),
            )
        return f"{vector} @@ {query}", (*params, self.search.text)

    def as_sql(  # type: ignore[override]
        self, compiler: Any, connection: Any, **extra: Any
    ) -> Any:
        sql, params = compiler.compile(self.source_expressions[0])
        text = f"COALESCE(JSON_EXTRACT({sql}, '$.text'), '')"
        # Words are letters and digits: nothing LIKE would read as a wildcard.
        conditions = " AND ".join(f"{text} LIKE %s" for _ in self.search.words)
        values = [(*params, f"%{word}%") for word in self.search.words]
        return f"({conditions})", tuple(v for pair in values for v in pair)


def with_transcript(
    items: QuerySet[BatchItem], search: Search, *, indexed: bool = True, key: str = ""
) -> QuerySet[BatchItem]:
    """The ``items`` whose job is completed with a transcript that matches
    (``indexed=False``: tested transcript by transcript on PostgreSQL; ``key``:
    through the index for that word alone, see ``Density``)."""
    return items.filter(job__status=JobStatus.COMPLETED).filter(
        TranscriptMatches("job__result", search, indexed=indexed, key=key)
    )


def jobs_with_transcript(jobs: QuerySet[Job], search: Search) -> QuerySet[Job]:
    """The ``jobs`` that are completed with a transcript that matches (the
    index's own rows on PostgreSQL)."""
    return jobs.filter(status=JobStatus.COMPLETED).filter(
        TranscriptMatches("result", search)
    )


def in_batch_with_transcript(batch_id: int, search: Search) -> QuerySet[BatchItem]:
    """The batch's items whose transcript matches: the job's batch too, so that
    PostgreSQL can intersect the word's index entries with the batch's jobs."""
    return with_transcript(
        BatchItem.objects.filter(batch_id=batch_id, job__batch_id=batch_id), search
    )


# Item ids in a page's first window when PostgreSQL has no statistics of the
# index (``in_windows``); each next window is at least twice as wide.
FIRST_WINDOW = 256
# Testing one transcript (its result read, its text parsed into a vector)
# costs about as much as reading this many entries of the index (measured on
# transcripts of ~150 words): what ``in_windows`` weighs, window by window.
ENTRIES_PER_TEST = 1000
# How much wider than the density says a window is drawn (its share of chance).
SPARE = 1.25
# Reading a match's row from the table and sorting it, in entries of the index.
ENTRIES_PER_MATCH = 20
# A window through the index reads at most this many times as much in matches
# as in the index's entries of the key (``in_windows``).
WINDOW_COST = 4


def item_ids(items: QuerySet[BatchItem]) -> tuple[int, int] | None:
    """The lowest and the highest id of ``items`` (None when there are none):
    two probes of an index on the ids, to run outside ``through_the_index``."""
    bounds = items.aggregate(low=Min("pk"), high=Max("pk"))
    if bounds["low"] is None:
        return None
    return bounds["low"], bounds["high"]


@dataclass(frozen=True)
class Density:
    """What PostgreSQL's statistics of the index (its last ANALYZE) say of a
    search: the share of the completed transcripts that have every word (the
    words taken as independent; a word too rare to be listed counts half the
    rarest listed one's share, as the planner counts it), how many
    transcripts the index holds, and the key: the search's rarest word.

    PostgreSQL does not read these statistics itself (they are a partial
    index's): it guesses every word in 0.5% of the transcripts, a search of
    two words in 0.0025%, and for so few matches it reads them all rather
    than AND them with a window's items. Asked for the key alone it guesses
    0.5% and ANDs; the search is tested on the few transcripts found.
    ``key`` is "" when no word of the search is one that PostgreSQL's parser
    gives back alone (the index is then asked for the whole search)."""

    share: float
    entries: float
    key: str
    key_share: float  # the key's share (the search's, without a key)


def density_of(search: Search) -> Density | None:
    """The search's ``Density`` (None without statistics: a new index). The
    words are PostgreSQL's (its parser's lexemes of the search), the ones the
    index holds."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT w, s.most_common_elem_freqs[array_position("
            f"s.most_common_elems::text::text[], w)], "
            f"s.most_common_elem_freqs[array_length(s.most_common_elem_freqs, 1) - 2], "
            f"(SELECT c.reltuples FROM pg_class c WHERE c.oid = %s::regclass), "
            f"strip(to_tsvector('{SEARCH_CONFIG}'::regconfig, w)) "
            f"= array_to_tsvector(ARRAY[w]) "
            f"FROM unnest(tsvector_to_array("
            f"to_tsvector('{SEARCH_CONFIG}'::regconfig, %s))) AS w "
            f"JOIN pg_stats s ON s.schemaname = current_schema() AND s.tablename = %s",
            [INDEX_NAME, search.text, INDEX_NAME],
        )
        rows = cursor.fetchall()
    if not rows or any(r[2] is None or r[3] <= 0 for r in rows):
        return None
    share, key, rarest = 1.0, "", 2.0
    for word, listed, least, _, alone in rows:
        frequency = listed if listed is not None else least / 2
        share *= frequency
        if alone and frequency < rarest:
            key, rarest = word, frequency
    if len(rows) == 1 or not key:
        return Density(share, rows[0][3], "", share)
    return Density(share, rows[0][3], key, rarest)


def in_windows(
    items: QuerySet[BatchItem],
    search: Search,
    need: int,
    low: int,
    high: int,
    *,
    descending: bool = False,
) -> list[BatchItem]:
    """The first ``need`` of ``items`` whose transcript matches the search and
    whose ids are from ``low`` to ``high``, in id order (from ``high`` down
    with ``descending``): what ``with_transcript(items, search).filter(
    pk__range=(low, high)).order_by("pk")[:need]`` returns.

    On PostgreSQL, inside ``through_the_index``, read a window of ids at a time
    until ``need`` are found or the range is crossed, each window one of two
    ways, whichever costs less:

    * through the index: the word's entries ANDed with the window's jobs (by
      item id). It costs the word's entries, however narrow the window: the
      way for a word in few transcripts, whose entries are few.
    * testing the window's transcripts one by one: it costs the window's
      items, however common the word: the way for a word in most transcripts,
      whose window is about a page wide.

    The first window is as wide as the statistics of the index say a page
    needs (``FIRST_WINDOW`` without statistics); each next one as wide as the
    windows read so far say the rest of the page needs, and through the index
    at least twice as wide as the last (four times after windows without a
    match), but never so wide that its matches would cost more than
    ``WINDOW_COST`` times the key's entries; after a window without a match
    the next begins at the nearest done item (``_nearest_done``), past the
    ids of items queued or running. So a page costs about a page for
    a common word and a dozen look-ups of a few entries for a word in none,
    where one query would fetch and sort every match after the cursor. A
    search of several words is read through the index for its key (its
    rarest word, ``Density``) and tested on what that finds.

    Elsewhere (SQLite scans the transcripts anyway) one query."""
    if need <= 0 or low > high:
        return []
    ordering = "-pk" if descending else "pk"
    if connection.vendor != "postgresql":
        matches = with_transcript(items, search).filter(pk__range=(low, high))
        return list(matches.order_by(ordering)[:need])
    stats = density_of(search)
    width = ceil(need / stats.share * SPARE) if stats else FIRST_WINDOW
    found: list[BatchItem] = []
    read = hits = 0  # ids in the windows read, matches in them
    while low <= high and len(found) < need:
        wanted = need - len(found)
        density = hits / read if read else stats.share if stats else 0.0
        # Testing ``wanted / density`` transcripts, or reading the entries.
        test = bool(stats) and wanted * ENTRIES_PER_TEST < (
            density * stats.share * stats.entries  # type: ignore[union-attr]
        )
        if descending:
            start, end = max(low, high - width + 1), high
            high = start - 1
        else:
            start, end = low, min(high, low + width - 1)
            low = end + 1
        key = stats.key if stats else ""
        window = with_transcript(items, search, indexed=not test, key=key).filter(
            pk__range=(start, end), job__item__gte=start, job__item__lte=end
        )
        rows = list(window.order_by(ordering)[:wanted])
        found.extend(rows)
        read, hits = read + end - start + 1, hits + len(rows)
        more = need - len(found)
        if not rows and low <= high:
            # Nothing here: go on from the nearest done item (a completed
            # job's), past the ids of items still queued or running.
            nearest = _nearest_done(items, low, high, descending=descending)
            if nearest is None:
                break
            if descending:
                high = nearest
            else:
                low = nearest
        guess = ceil(more / (hits / read) * SPARE) if hits else 0
        if not hits:  # a rare word, or ids of no transcript: each window
            width *= 4  # through the index costs its entries, so far fewer
        elif test:
            width = max(1, guess)
        else:
            width = max(2 * width, guess)
        if stats:
            # Through the index, a window costs the key's entries, and then
            # each match of the key in it: read, sorted, and tested too when
            # the search has more words. After windows of ids of no transcript
            # (queued jobs) the next may be where the key is in most: never
            # more matches than cost WINDOW_COST times the entries.
            each = ENTRIES_PER_TEST if stats.key else ENTRIES_PER_MATCH
            most = WINDOW_COST * stats.entries / each / stats.key_share
            width = min(width, max(ceil(most), 1))
    return found


def _nearest_done(
    items: QuerySet[BatchItem], low: int, high: int, *, descending: bool
) -> int | None:
    """The id of the first done item of ``items`` from ``low`` to ``high``
    (from ``high`` down with ``descending``): a walk of an index on the ids
    (the batch's status and id, within a batch), so index scans are allowed
    for it alone inside ``through_the_index``."""
    ordering = "-pk" if descending else "pk"
    done = items.filter(status=ItemStatus.DONE, pk__range=(low, high))
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_indexscan = on")
        try:
            first = list(done.order_by(ordering).values_list("pk", flat=True)[:1])
        finally:
            cursor.execute("SET LOCAL enable_indexscan = off")
    return first[0] if first else None


@contextmanager
def through_the_index() -> Iterator[None]:
    """Run the searches inside on PostgreSQL from the full-text index alone
    (bitmap scans, then a sort of the matches), never from an ordered walk of
    the items that tests each transcript on the way.

    With a LIMIT, PostgreSQL prefers that walk whenever it believes a word
    common; for a word it cannot see in its statistics it guesses 0.5% of the
    rows, and for an item's own word (one hit in a million) the walk computed
    a million vectors: minutes (row 22 of the benchmarks). Through the index
    alone a query costs its matches: nothing for a rare word, a sort of every
    match for a word in most transcripts, unless ``in_windows`` reads it."""
    if connection.vendor != "postgresql":
        yield
        return
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "SET LOCAL enable_indexscan = off; SET LOCAL enable_indexonlyscan = off; "
            "SET LOCAL enable_seqscan = off"
        )
        yield


# --- What a hit shows -----------------------------------------------------------

SNIPPET_BEFORE = 80  # characters of context before the first match
SNIPPET_CHARS = 240  # characters of the excerpt in all
MAX_SEGMENTS_READ = 10_000


def transcript_of(result: object) -> str:
    """The transcript of a stored result ('' when it has none)."""
    text = result.get("text") if isinstance(result, dict) else None
    return text if isinstance(text, str) else ""


def _matches(text: str, search: Search, *, substrings: bool) -> Iterable[re.Match]:
    """Where the search's words are in ``text``: whole words, or anywhere in a
    word with ``substrings`` (the SQLite match)."""
    if substrings:
        alternatives = sorted(search.words, key=len, reverse=True)
        pattern = "|".join(re.escape(word) for word in alternatives)
        return re.finditer(pattern, text, re.IGNORECASE)
    wanted = set(search.words)
    return (m for m in WORD.finditer(text) if m.group().lower() in wanted)


def snippet(text: str, search: Search, *, substrings: bool = False) -> SafeString:
    """An excerpt of ``text`` around the first word of the search found, as
    HTML: the text escaped, each word found in ``<mark>``. The start of the
    text when no word is found (a match PostgreSQL's parser made differently)."""
    text = text[:INDEXED_CHARS]
    found = list(_matches(text, search, substrings=substrings))
    first = found[0].start() if found else 0
    start = max(0, first - SNIPPET_BEFORE)
    if start:  # begin at a word
        space = text.find(" ", start, first)
        start = space + 1 if space != -1 else start
    end = min(len(text), start + SNIPPET_CHARS)
    if end < len(text):
        space = text.rfind(" ", max(first + 1, start), end)
        end = space if space > first else end
    parts = ["…"] if start else []
    at = start
    for match in found:
        if match.start() < at:
            continue
        if match.end() > end:
            break
        parts.append(escape(text[at : match.start()]))
        parts.append(f"<mark>{escape(match.group())}</mark>")
        at = match.end()
    parts.append(escape(text[at:end]))
    if end < len(text):
        parts.append("…")
    return mark_safe("".join(parts))


def first_matching_segment(
    result: object, search: Search, *, substrings: bool = False
) -> float | None:
    """The start (seconds) of the first timed segment of ``result`` whose text
    holds a word of the search; None when none does or there are none."""
    segments = result.get("segments") if isinstance(result, dict) else None
    if not isinstance(segments, list):
        return None
    for segment in segments[:MAX_SEGMENTS_READ]:
        if not isinstance(segment, dict):
            continue
        start, text = segment.get("start"), segment.get("text")
        if (
            isinstance(start, int | float)
            and not isinstance(start, bool)
            and start >= 0
            and isinstance(text, str)
            and next(iter(_matches(text, search, substrings=substrings)), None)
        ):
            return float(start)
    return None


def format_offset(seconds: float) -> str:
    """A time into the recording: ``m:ss``, or ``h:mm:ss`` past an hour."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"


def matches_substrings() -> bool:
    """True where the match is by substring (SQLite), so that an excerpt
    marks what the database matched."""
    return connection.vendor != "postgresql"


@dataclass(frozen=True)
class Hit:
    """One item a search found, as the search page shows it."""

    item: BatchItem
    snippet: SafeString
    start: float | None  # seconds: the first matching timed segment's start

    @property
    def start_text(self) -> str:
        return "" if self.start is None else format_offset(self.start)


def hits(items: Iterable[BatchItem], search: Search) -> list[Hit]:
    """The excerpt and the first matching segment of each of ``items`` (read
    with their jobs' results)."""
    substrings = matches_substrings()
    found = []
    for item in items:
        result = item.job.result
        found.append(
            Hit(
                item,
                snippet(transcript_of(result), search, substrings=substrings),
                first_matching_segment(result, search, substrings=substrings),
            )
        )
    return found
