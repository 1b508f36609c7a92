"""The short chaos run (about a minute) that `make test` and CI include; `make
chaos` runs the long one. See tests/system/chaos.py for what it does and checks."""

import re
import subprocess
import sys

import pytest

from harness.pgserver import available
from harness.server import ROOT

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        not available(), reason="PostgreSQL server binaries not installed"
    ),
]


def test_a_short_chaos_run_loses_nothing_and_lies_about_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "tests.system.chaos", "--duration", "45", "--workers", "6",
         "--items", "400", "--lease", "3", "--kill-every", "3", "--drain", "120",
         "--nodes", "2", "--node-kill-every", "12"],
        cwd=ROOT, capture_output=True, text=True, timeout=420,
    )  # fmt: skip

    summary = [
        line
        for line in result.stdout.splitlines()
        if re.match(r"chaos: \d+ jobs", line)
    ]
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert len(summary) == 1
    assert re.search(
        r"1 db restart, lost 0, duplicated 0, mismatched 0, 5xx 0", summary[0]
    )
    assert "poison failed as it should" in summary[0]
    assert re.search(r"chaos: fair share ok: weights 1:2:3", result.stdout)
    webhooks = re.search(
        r"webhooks: (\d+) batches, (\d+) batch.finished \(duplicated 0, missing 0, "
        r"1 cancelled\), (\d+) item.failed, (\d+)/(\d+) delivered, undelivered 0, "
        r"bad signatures 0",
        summary[0],
    )
    assert webhooks, summary[0]
    batches, finished, failed, delivered, events = map(int, webhooks.groups())
    assert batches == finished == 7  # three weighted, four small
    assert failed >= 1
    assert delivered == events == finished + failed
    kills = int(re.search(r"(\d+) kills", summary[0]).group(1))
    assert kills >= 10
    # Two web nodes (one with its clock 90 s fast), two clusters, nodes killed.
    assert "chaos: 2 web nodes on ports" in result.stdout
    assert "2 django-q2 clusters" in result.stdout
    node_kills = int(re.search(r"(\d+) nodes\)", summary[0]).group(1))
    assert node_kills >= 1
