"""Row 21 of ``make bench`` (``--only 21``, BENCHMARKS.md): HTTP claims of up to 8
jobs at once (``max_jobs``) plus their completions in one batched completion
(``POST /api/v1/complete``), against the raw-SQL limit and the peers (issue 26).
"""

from __future__ import annotations

import statistics

from bench.core import Bench


def claim_many(bench: Bench) -> None:
    """21: HTTP claims of several jobs at once plus their batched completion,
    against the raw-SQL limit and the peers."""
    from bench.scenarios.peers import peer_rates
    from bench.scenarios.throughput import _throughput

    n = bench.sizes.claim_max_jobs
    runs: dict[str, list[float]] = {"raw": [], "one": [], "many": []}
    report: list[dict] = []
    for _ in range(bench.sizes.runs):
        # Interleaved, as row 1, so a slow spell of the machine hits each alike.
        runs["raw"].append(_throughput(bench, "raw"))
        runs["one"].append(_throughput(bench, "http_api"))
        runs["many"].append(
            _throughput(bench, "http_api_jobs", report=report, max_jobs=n)
        )
    raw, one, many = (statistics.median(runs[k]) for k in ("raw", "one", "many"))
    p = bench.p
    per_claim = sum(r["done"] for r in report) / max(
        1, sum(r["claims"] for r in report)
    )
    bench.add(
        "21",
        "HTTP claim of many",
        f'claim with "max_jobs": {n}, then its jobs completed in one batched '
        f"completion: claim+complete/s, P={p}, {per_claim:.1f} jobs per claim "
        "(one job per claim, row 3's loop, beside it; raw-SQL limit)",
        f"{many:.0f}/s = {many / raw:.2f} x raw ({one:.0f}/s = {one / raw:.2f} x "
        f"raw; {raw:.0f}/s)",
    )
    # The peers as row 4 measures them (once per run of make bench).
    rates = peer_rates(bench)
    ahead = {key: many / rate for key, rate in rates.items()}
    bench.add(
        "21",
        "HTTP claim of many",
        f"over each peer's no-op jobs/s, P={p}: "
        + ", ".join(
            f"{name} {'tuned' if tuned else 'stock'} ({rate:.0f}/s)"
            for (name, tuned), rate in rates.items()
        ),
        " / ".join(f"{ratio:.2f} x" for ratio in ahead.values()),
        "ahead of every peer, tuned included",
        min(ahead.values()) > 1,
    )
