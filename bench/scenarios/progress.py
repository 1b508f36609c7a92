"""Row 7 of ``make bench`` (``--only 7``, BENCHMARKS.md): progress.json and the batch
page of the million-item batch, live.
"""

from __future__ import annotations

import statistics
import threading
import time

from bench.core import Bench, _ms, _workers
from bench.scenarios.sweep import sweep


def progress(bench: Bench) -> None:
    """7: progress.json and the batch page of the million-item batch, live."""
    from django.contrib.auth import get_user_model
    from django.db.models import Count
    from django.test import Client

    from batches.models import Batch, BatchItem
    from bench import loops

    big = bench.figures.get("big_batch")
    if big is None or "6" not in bench.scenarios:
        sweep(bench)  # leaves the batch with its expired leases queued again
        big = bench.figures["big_batch"]
    User = get_user_model()
    user = User.objects.filter(username="bench").first() or User.objects.create_user(
        "bench", is_staff=True, is_superuser=True
    )
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    workers = _workers(bench.p)
    done_before = Batch.objects.get(pk=big).counts()["done"]
    going = threading.Event()
    thread = threading.Thread(
        target=loops.run,
        args=("model", [{"worker": w.pk} for w, _ in workers]),
        kwargs={
            "duration": max(3.0, bench.sizes.throughput_seconds),
            "started": going,
        },
    )
    thread.start()
    going.wait(timeout=180)
    time.sleep(0.3)
    timings: dict[str, list[float]] = {"json": [], "page": []}
    for _ in range(bench.sizes.page_requests):
        for key, path in (
            ("json", f"/batches/{big}/progress.json"),
            ("page", f"/batches/{big}/"),
        ):
            t0 = time.perf_counter()
            response = client.get(path)
            timings[key].append(time.perf_counter() - t0)
            if response.status_code != 200:
                raise RuntimeError(f"GET {path} answered {response.status_code}")
    during = Batch.objects.get(pk=big).counts()["done"] - done_before
    thread.join()
    shown = client.get(f"/batches/{big}/progress.json").json()
    fresh = {
        row["status"]: row["n"]
        for row in BatchItem.objects.filter(batch_id=big)
        .values("status")
        .annotate(n=Count("id"))
        .order_by()
    }
    exact = all(shown["counts"][s] == fresh.get(s, 0) for s in shown["counts"])
    label = f"{shown['total']:,} items, {during:,} finished meanwhile"
    for key, name, limit in (
        ("json", "progress.json", 0.1),
        ("page", "batch page", 0.3),
    ):
        median = statistics.median(timings[key])
        bench.add(
            "7",
            "progress",
            f"{name} median (max), {label}",
            f"{_ms(median)} ({_ms(max(timings[key]))})",
            f"<= {limit * 1000:.0f} ms",
            median <= limit,
        )
    bench.add(
        "7",
        "progress",
        "counts equal a fresh recount once quiet",
        "yes" if exact else "NO",
        "exact",
        exact,
    )
