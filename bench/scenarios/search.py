"""Row 22 of ``make bench`` (``--only 22``, BENCHMARKS.md): searching the
transcripts of a batch of a million items of about 150 words each, the full-text
index's size, and what the index costs completions (issue 29).

The transcripts are seeded with SQL (``generate_series``): each is ten
sentences of 15 words drawn from a pool of sentences, and a word of its own
(``ref<item id>``). The pool's words come from a vocabulary of 13,824
made-up words drawn log-uniformly (rank r about as often as 1/r, as words are
in speech), so a search may hit most transcripts, a few thousand, one or none.
"""

from __future__ import annotations

import random
import statistics
import time
from datetime import timedelta

from bench.core import Bench, _ms, _pct, _rate, _workers

SYLLABLES = (
    "ka", "lo", "re", "mi", "tu", "sa", "ne", "po", "di", "fa", "gu", "he",
    "ji", "ko", "lu", "ma", "no", "pe", "ri", "so", "ta", "vu", "we", "ze",
)  # fmt: skip
VOCABULARY = len(SYLLABLES) ** 3
SENTENCES = 20_000
SENTENCE_WORDS = 15
PER_TRANSCRIPT = 10  # sentences: 150 words, and the item's own word
SEGMENT_SECONDS = 6


def word(rank: int) -> str:
    """The made-up word of ``rank`` (0-based, most frequent first)."""
    n = len(SYLLABLES)
    return SYLLABLES[rank % n] + SYLLABLES[rank // n % n] + SYLLABLES[rank // n // n]


def _rank(rng: random.Random) -> int:
    """A rank drawn log-uniformly: rank r about as often as 1/r (Zipf)."""
    return min(VOCABULARY - 1, int(VOCABULARY ** rng.random()) - 1)


def _seed_sentences(rng: random.Random) -> None:
    """The pool of sentences, in a temporary table of this connection."""
    from django.db import connection

    rows = [
        (n, " ".join(word(_rank(rng)) for _ in range(SENTENCE_WORDS)))
        for n in range(1, SENTENCES + 1)
    ]
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS bench_sentence")
        cursor.execute(
            "CREATE TEMPORARY TABLE bench_sentence (id int PRIMARY KEY, text text)"
        )
        cursor.executemany("INSERT INTO bench_sentence VALUES (%s, %s)", rows)
        cursor.execute("ANALYZE bench_sentence")


# A done job's result: ten sentences of the pool, picked at random for each
# item, as the text and as timed segments, and the item's own word.
TRANSCRIPT = f"""(
    SELECT jsonb_build_object(
        'text', string_agg(s.text, ' ' ORDER BY p.k) || ' ref' || i.id,
        'language', 'en',
        'segments', jsonb_agg(jsonb_build_object(
            'start', (p.k - 1) * {SEGMENT_SECONDS}, 'end', p.k * {SEGMENT_SECONDS},
            'text', s.text) ORDER BY p.k))
    FROM (SELECT k, 1 + floor(random() * {SENTENCES})::int AS pick
          FROM generate_series(1, {PER_TRANSCRIPT}) AS k WHERE i.id > 0) AS p
    JOIN bench_sentence s ON s.id = p.pick
)"""


def transcript(rng: random.Random) -> dict:
    """A result as a worker sends it, with a transcript like the seeded ones."""
    sentences = [
        " ".join(word(_rank(rng)) for _ in range(SENTENCE_WORDS))
        for _ in range(PER_TRANSCRIPT)
    ]
    return {
        "text": " ".join(sentences),
        "language": "en",
        "segments": [
            {
                "start": k * SEGMENT_SECONDS,
                "end": (k + 1) * SEGMENT_SECONDS,
                "text": text,
            }
            for k, text in enumerate(sentences)
        ],
    }


def _queries(rng: random.Random, n: int, items: list[int]) -> list[str]:
    """A mix of searches: words from common to rare, two words, an item's own
    word (one hit) and a word no transcript has."""
    queries = []
    for k in range(n):
        kind = k % 5
        if kind in (0, 1):
            queries.append(word(_rank(rng)))
        elif kind == 2:
            queries.append(f"{word(_rank(rng))} {word(_rank(rng))}")
        elif kind == 3:
            queries.append(f"ref{rng.choice(items)}")
        else:
            queries.append(f"nowhere{k}")
    return queries


def _index_size() -> tuple[int, int]:
    """The search index's size and the jobs table's (bytes)."""
    from django.db import connection

    from jobs.search import INDEX_NAME

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_relation_size(%s::regclass), pg_total_relation_size('jobs_job')",
            [INDEX_NAME],
        )
        return cursor.fetchone()


def _drop_index() -> None:
    from django.db import connection

    from jobs.search import INDEX_NAME

    with connection.cursor() as cursor:
        cursor.execute(f"DROP INDEX IF EXISTS {INDEX_NAME}")


def _create_index() -> float:
    """Build the index as migration jobs.0017 does (not concurrently: nothing
    else runs); seconds it took. Then fresh statistics of its expression."""
    from django.db import connection

    from jobs.search import INDEX_NAME, transcript_vector_sql

    t0 = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SET maintenance_work_mem = '256MB'")
        cursor.execute(
            f"CREATE INDEX {INDEX_NAME} ON jobs_job USING gin "
            f"({transcript_vector_sql('result')}) WHERE status = 'completed'"
        )
        cursor.execute("RESET maintenance_work_mem")
        took = time.perf_counter() - t0
        cursor.execute("ANALYZE jobs_job")
    return took


def _completions(bench: Bench, results: list[dict]) -> tuple[float, float | None]:
    """Claim + complete per second, model layer, P processes, completing with
    the transcripts ``results``, from a fresh batch of queued jobs of its own
    (paused afterwards, so that no run shares its claims with another's
    leftovers); and the CPU per claim + complete (the loops' and, on the
    private server, PostgreSQL's: None on another server), less moved by
    other load."""
    from batches.models import Batch
    from bench import loops, seed
    from bench.cpu import cpu_seconds
    from bench.loops import utcnow

    queue = seed.batch(
        f"bench-search-queue-{Batch.objects.count()}",
        now=utcnow(),
        queued=bench.sizes.throughput_jobs,
        analyze=False,
    )
    workers = _workers(bench.p)
    args = [{"worker": w.pk, "results": results} for w, _ in workers]
    before = cpu_seconds(bench.postmaster) if bench.postmaster else None
    reports = loops.run("model", args, duration=bench.sizes.throughput_seconds)
    Batch.objects.filter(pk=queue.pk).update(paused_at=utcnow())
    done = sum(r["done"] for r in reports)
    if before is None or not done:
        return _rate(reports), None
    database = cpu_seconds(bench.postmaster) - before
    return _rate(reports), (database + sum(r["cpu"] for r in reports)) / done


def search(bench: Bench) -> None:
    """22: searching a million transcripts; the index's size; completions with
    the index and without it."""
    from django.db import connection

    from bench import seed
    from bench.loops import utcnow

    sizes = bench.sizes
    rng = random.Random(22)
    seed.reset()
    _drop_index()  # built after the seed, as a migration on a full table would
    _seed_sentences(rng)
    now = utcnow()
    t0 = time.perf_counter()
    big = seed.batch(
        "bench-transcripts",
        now=now - timedelta(minutes=5),
        completed=sizes.search_items,
        analyze=False,
        done_result=TRANSCRIPT,
    )
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE jobs_job")
        cursor.execute("VACUUM ANALYZE batches_batchitem")
    seeded = time.perf_counter() - t0
    results = [transcript(rng) for _ in range(50)]

    with_index: list[tuple[float, float | None]] = []
    without: list[tuple[float, float | None]] = []
    built = 0.0
    for run in range(sizes.runs):
        # Without, with, with, without (ABBA): a load that rises or falls
        # through the round moves both sides alike. Building the index takes
        # minutes at a million transcripts; dropping it, a moment.
        without.append(_completions(bench, results))
        built = _create_index()
        if run == 0:
            index_bytes, table_bytes = _index_size()
            searched = _searches(bench, big.pk, rng)
        with_index.append(_completions(bench, results))
        with_index.append(_completions(bench, results))
        _drop_index()
        without.append(_completions(bench, results))

    times, pages, hits_seen = searched["api"], searched["pages"], searched["hits"]
    p50, p99 = _pct(times, 0.5), _pct(times, 0.99)
    label = f"a batch of {sizes.search_items:,} transcripts of ~150 words"
    bench.add(
        "22",
        "search",
        f"{label}: API page (up to 100 items, q=WORDS) p50 / p99, of {pages:,} "
        f"pages ({len(searched['queries']):,} searches and their next pages, "
        f"{hits_seen:,} hits)",
        f"{_ms(p50)} / {_ms(p99)}",
        "p50 <= 100 ms",
        p50 <= 0.1,
    )
    page50, page99 = _pct(searched["page"], 0.5), _pct(searched["page"], 0.99)
    bench.add(
        "22",
        "search",
        f"the search page (/search/?q=, 25 hits with excerpts, every batch), "
        f"the same searches: p50 / p99 of {len(searched['page']):,}",
        f"{_ms(page50)} / {_ms(page99)}",
    )
    bench.add(
        "22",
        "search",
        f"the full-text index over {sizes.search_items:,} transcripts: size "
        f"(jobs table with its indexes and TOAST); built in (seeded in)",
        f"{index_bytes / 2**20:,.0f} MB ({table_bytes / 2**20:,.0f} MB); "
        f"{built:.0f} s ({seeded:.0f} s)",
    )
    rate_with = statistics.median(rate for rate, _ in with_index)
    rate_without = statistics.median(rate for rate, _ in without)
    ratio = rate_with / rate_without if rate_without else float("nan")
    cpu_with = [cpu for _, cpu in with_index if cpu is not None]
    cpu_without = [cpu for _, cpu in without if cpu is not None]
    cpu = (
        f" (CPU per claim+complete, loops + PostgreSQL: "
        f"{_ms(statistics.median(cpu_with))} / "
        f"{_ms(statistics.median(cpu_without))})"
        if cpu_with and cpu_without
        else ""
    )
    bench.add(
        "22",
        "search",
        f"completions of ~150-word transcripts, model layer, P={bench.p}: "
        f"claim+complete/s with the index / without it (median of "
        f"{2 * sizes.runs} each, in rounds of without, with, with, without)",
        f"{rate_with:.0f}/s / {rate_without:.0f}/s = {ratio:.2f}{cpu}",
        ">= 0.90",
        ratio >= 0.9,
    )


def _searches(bench: Bench, batch_id: int, rng: random.Random) -> dict:
    """Time the API's item search and the search page over the query mix,
    one client, in this process (the server's time, not a queue's)."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    from batches.models import BatchItem
    from bench.loops import utcnow
    from operator_api.tokens import issue_token

    User = get_user_model()
    user = User.objects.filter(username="bench").first() or User.objects.create_user(
        "bench", is_staff=True, is_superuser=True
    )
    _, token = issue_token(user, label="bench search", now=utcnow())
    api = Client(HTTP_HOST="127.0.0.1", HTTP_AUTHORIZATION=f"Bearer {token}")
    page = Client(HTTP_HOST="127.0.0.1")
    page.force_login(user)
    first = BatchItem.objects.filter(batch_id=batch_id).order_by("pk")[:1][0].pk
    items = [first + rng.randrange(bench.sizes.search_items) for _ in range(100)]
    queries = _queries(rng, bench.sizes.search_queries, items)
    url = f"/api/v1/batches/{batch_id}/items"
    api.get(url, {"q": queries[0]})  # warm: the first request sets things up
    timings: dict[str, list[float]] = {"api": [], "page": []}
    hits = 0
    for q in queries:
        cursor = None
        for _ in range(2):  # the first page, and the next one when there is one
            params = {"q": q} if cursor is None else {"q": q, "cursor": cursor}
            t0 = time.perf_counter()
            response = api.get(url, params)
            timings["api"].append(time.perf_counter() - t0)
            if response.status_code != 200:
                raise RuntimeError(f"GET {url}?q={q} answered {response.status_code}")
            body = response.json()
            hits += len(body["items"])
            cursor = body["next_cursor"]
            if cursor is None:
                break
        t0 = time.perf_counter()
        response = page.get("/search/", {"q": q})
        timings["page"].append(time.perf_counter() - t0)
        if response.status_code != 200:
            raise RuntimeError(f"GET /search/?q={q} answered {response.status_code}")
    return {**timings, "pages": len(timings["api"]), "hits": hits, "queries": queries}
