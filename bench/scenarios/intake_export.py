"""Row 9 of ``make bench`` (``--only 9``, BENCHMARKS.md): create_batch of a large
manifest; CSV export of the million-item batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from bench.core import ROOT, Bench
from bench.scenarios.idle import idle


def _measure_child(
    command: list[str], env: dict | None = None
) -> tuple[float, float, str]:
    """Run a command; return its wall time, peak RSS (MB) and output."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
        )
        _, status, usage = os.wait4(process.pid, 0)
        took = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{text}")
    return took, usage.ru_maxrss / 1024, text


def intake_export(bench: Bench) -> None:
    """9: create_batch of a large manifest; CSV export of the million-item batch."""
    n = bench.sizes.intake_items
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as manifest:
        manifest.write("source,duration_seconds,language\n")
        for i in range(n):
            manifest.write(f"s3://bench/audio/{i:07d}.flac,{30 + i % 600},en\n")
    try:
        took, rss, _ = _measure_child(
            [sys.executable, "manage.py", "create_batch", "bench-intake", manifest.name]
        )
    finally:
        os.unlink(manifest.name)
    bench.add(
        "9",
        "intake",
        f"create_batch of {n:,} items (peak RSS {rss:.0f} MB)",
        f"{took:.1f} s",
        "<= 10 s",
        took <= 10,
    )
    big = bench.figures.get("big_batch")
    if big is None:
        idle(bench)
        big = bench.figures["big_batch"]
    took, rss, text = _measure_child(
        [sys.executable, "-m", "bench.export_child", str(big), "csv"]
    )
    rows = int(text.split()[-1])
    bench.add(
        "9",
        "export",
        f"CSV of {rows:,} items ({took:.1f} s)",
        f"peak RSS {rss:.0f} MB",
        "<= 200 MB",
        rss <= 200,
    )
