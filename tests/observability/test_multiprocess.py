"""Request metrics across processes: real metric files written by real
processes; a dead worker's counts survive in the archive, its files go."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from harness.server import ROOT
from recall_site import metric_files as multiprocess
from tests.support.metrics import CLAIMS, count_in_a_process, samples


def totals(path: Path) -> dict[tuple, float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    with multiprocess.reading(str(path)):
        return samples(generate_latest(registry))


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.db"))


COMPLETES = ("recall_api_requests_total", ("endpoint", "complete"), ("status", "200"))


def test_a_dead_workers_counts_move_into_the_archive(tmp_path):
    pids = [
        count_in_a_process(tmp_path, 3, 1),
        count_in_a_process(tmp_path, 5, 2),
        count_in_a_process(tmp_path, 2, 0),
    ]
    before = totals(tmp_path)
    assert before[CLAIMS] == 10
    assert before[COMPLETES] == 3
    assert before[("recall_claim_seconds_count",)] == 10
    assert before[("recall_claim_seconds_bucket", ("le", "0.0025"))] == 0
    assert before[("recall_claim_seconds_bucket", ("le", "0.005"))] == 10

    for pid in pids[:2]:
        multiprocess.retire(pid, str(tmp_path))

    assert totals(tmp_path) == before
    assert files(tmp_path) == sorted(
        [
            "counter_archive.db",
            "histogram_archive.db",
            f"counter_{pids[2]}.db",
            f"histogram_{pids[2]}.db",
        ]
    )

    multiprocess.retire(pids[2], str(tmp_path))
    multiprocess.retire(pids[2], str(tmp_path))  # twice: nothing left to fold

    assert totals(tmp_path) == before
    assert files(tmp_path) == ["counter_archive.db", "histogram_archive.db"]

    newcomer = count_in_a_process(tmp_path, 1, 4)
    multiprocess.retire(newcomer, str(tmp_path))

    after = totals(tmp_path)
    assert after[CLAIMS] == 11
    assert after[COMPLETES] == 7
    assert after[("recall_claim_seconds_count",)] == 11
    assert (
        after[("recall_claim_seconds_sum",)]
        == before[("recall_claim_seconds_sum",)] + 0.004
    )


def test_prepare_empties_the_directory(tmp_path):
    count_in_a_process(tmp_path, 2, 2)
    (tmp_path / "notes.txt").write_text("not a metrics file")

    multiprocess.prepare(str(tmp_path))

    assert files(tmp_path) == []
    assert (tmp_path / "notes.txt").exists()
    fresh = tmp_path / "new" / "dir"
    multiprocess.prepare(str(fresh))
    assert fresh.is_dir()


FRESH = """
import django
django.setup()
from api.request_metrics import request_metrics
request_metrics()
"""


def test_request_counts_are_exported_before_the_first_request(tmp_path):
    """A server process that answered nothing yet still exports
    recall_api_requests_total (HELP, TYPE, its usual series at 0): alerts and
    dashboards have data from the start (issue 27, item 9)."""
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "recall_site.settings",
    }
    subprocess.run(
        [sys.executable, "-c", FRESH], cwd=ROOT, env=env, timeout=60, check=True
    )
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    with multiprocess.reading(str(tmp_path)):
        text = generate_latest(registry).decode()

    assert "# HELP recall_api_requests_total Worker API requests answered" in text
    assert "# TYPE recall_api_requests_total counter" in text
    assert {
        (dict(key[1:])["endpoint"], dict(key[1:])["status"]): value
        for key, value in samples(text.encode()).items()
        if key[0] == "recall_api_requests_total"
    } == {
        ("claim", "200"): 0,
        ("claim", "204"): 0,
        ("heartbeat", "200"): 0,
        ("heartbeat_many", "200"): 0,
        ("complete", "200"): 0,
        ("complete_many", "200"): 0,
        ("fail", "200"): 0,
        ("release", "200"): 0,
    }
