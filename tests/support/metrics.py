"""Reading metrics: the samples of a scrape, and real processes counting
requests into a multiprocess metrics directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from harness.server import ROOT


def samples(text: str | bytes) -> dict[tuple, float]:
    """Every sample of a scrape: {(name, (label, value), ...): value}."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def by_label(scrape: dict[tuple, float], name: str) -> dict[str, float]:
    """One labelled family of a scrape, by its only label's value."""
    return {key[1][1]: v for key, v in scrape.items() if key[0] == name}


# A process counting API requests with Recall's own metric definitions.
COUNTING = """
import os, sys
import django
django.setup()
from api.request_metrics import request_metrics
metrics = request_metrics()
claims, completes = int(sys.argv[1]), int(sys.argv[2])
for _ in range(claims):
    metrics.requests.labels("claim", "204").inc()
    metrics.claim_seconds.observe(0.004)
for _ in range(completes):
    metrics.requests.labels("complete", "200").inc()
print(os.getpid())
"""


def count_in_a_process(path: Path, claims: int, completes: int) -> int:
    """Run a process that counts requests into ``path``; return its pid."""
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(path),
        "DJANGO_SETTINGS_MODULE": "recall_site.settings",
    }
    result = subprocess.run(
        [sys.executable, "-c", COUNTING, str(claims), str(completes)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(result.stdout.split()[-1])


CLAIMS = ("recall_api_requests_total", ("endpoint", "claim"), ("status", "204"))
