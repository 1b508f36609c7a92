"""Rows 1, 2, 3 and 8 of ``make bench`` (``--only 1``, BENCHMARKS.md): claim + complete
per second, raw SQL vs model layer vs HTTP.
"""

from __future__ import annotations

import statistics

from bench.core import Bench, _queue, _rate, _workers


def _throughput(
    bench: Bench, kind: str, batches: int = 1, report: list | None = None, **extra
) -> float:
    """Claim + complete per second of loop ``kind`` (``extra``: more arguments
    of an HTTP loop) in P processes, on a fresh queue in ``batches`` batches;
    each process's report appended to ``report``, if given."""
    from bench import loops

    workers = _workers(bench.p)
    batch_ids = _queue(bench, bench.sizes.throughput_jobs, batches)
    if kind == "raw":
        args = [
            {"dsn": bench.database_url, "batch": batch_ids[0], "worker": w.pk}
            for w, _ in workers
        ]
    elif kind == "model":
        args = [{"worker": w.pk} for w, _ in workers]
    else:
        args = [
            {"host": "127.0.0.1", "port": bench.server_port, "token": token, **extra}
            for _, token in workers
        ]
    results = loops.run(kind, args, duration=bench.sizes.throughput_seconds)
    if kind.startswith("http_api") and any(r["errors"] for r in results):
        raise RuntimeError(f"HTTP errors: {[r['errors'] for r in results]}")
    if report is not None:
        report.extend(results)
    return _rate(results)


def throughput(bench: Bench) -> None:
    """1-3 and 8: claim + complete per second, raw SQL vs model layer vs HTTP."""
    runs: dict[str, list[float]] = {"raw": [], "model": [], "http": [], "spread": []}
    want_http = bool({"3", "8"} & bench.scenarios)
    for _ in range(bench.sizes.runs):
        # Interleaved, so a slow spell of the machine hits every kind alike.
        runs["raw"].append(_throughput(bench, "raw"))
        runs["model"].append(_throughput(bench, "model"))
        if want_http:
            runs["http"].append(_throughput(bench, "http_api"))
            if "8" in bench.scenarios:
                spread = _throughput(bench, "http_api", bench.sizes.hot_batches)
                runs["spread"].append(spread)
    raw = statistics.median(runs["raw"])
    model = statistics.median(runs["model"])
    bench.figures.update(raw=raw, model=model)
    p = bench.p
    bench.add("1", "raw-SQL limit", f"claim+complete/s, P={p}", f"{raw:.0f}/s")
    bench.add(
        "2",
        "model layer",
        f"claim+complete/s, P={p}",
        f"{model:.0f}/s = {model / raw:.2f} x raw",
        ">= 0.70 x raw",
        model / raw >= 0.7,
    )
    if want_http:
        one = statistics.median(runs["http"])
        bench.figures["http"] = one
        bench.add(
            "3",
            "HTTP API (gunicorn)",
            f"claim+complete/s, P={p}",
            f"{one:.0f}/s = {one / raw:.2f} x raw",
            ">= 0.25 x raw",
            one / raw >= 0.25,
        )
    if "8" in bench.scenarios:
        spread = statistics.median(runs["spread"])
        bench.add(
            "8",
            "hot rows",
            f"HTTP 1 batch vs {bench.sizes.hot_batches} batches",
            f"{one:.0f}/s vs {spread:.0f}/s = {one / spread:.2f}",
            ">= 0.90",
            one / spread >= 0.9,
        )
