"""The Operator API page's examples (docs/reference/operator-api.md), run as
printed with curl against a live server: every curl line must succeed (HTTP 2xx)
and do what the text says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zipfile

import pytest

from batches.models import Batch
from jobs import transitions
from jobs.models import Event
from operator_api import tokens
from tests.support.factories import make_batch, make_user
from tests.support.worker import ROOT

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, reset_sequences=True),
    pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl"),
]


def page_examples() -> str:
    """The shell blocks of the Operator API page (recallctl has a page of its own)."""
    page = (ROOT / "docs" / "reference" / "operator-api.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", page, flags=re.S)
    assert len(blocks) >= 7
    return "\n".join(blocks)


def test_the_docs_curl_examples_work_as_printed(live_server, tmp_path):
    # The examples act on batch 4 and page from batch 1: three batches exist.
    for n in range(3):
        make_batch(2, name=f"earlier-{n}")
    user = make_user("pipeline", "Operators")
    _, token = tokens.issue_token(user, label="readme", now=transitions.now())
    # Every curl fails on an HTTP error (with its body), and the script stops.
    script = "set -e\n" + page_examples().replace(
        "curl -s ", "curl -sS --fail-with-body "
    )
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(RECALL_URL=live_server.url, RECALL_API_TOKEN=token)

    done = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, (done.stdout, done.stderr)
    batch = Batch.objects.get(pk=4)
    assert (batch.name, batch.priority, batch.total, batch.created_by) == (
        "calls 2026-12-02",
        5,
        2,
        user,
    )
    assert batch.cancelled_at is not None  # the last example cancels it
    kinds = set(Event.objects.filter(actor=user).values_list("kind", flat=True))
    assert kinds >= {"batch_paused", "batch_resumed", "batch_cancelled"}
    assert (tmp_path / "calls.csv").read_text().startswith("item,source,state")
    assert (tmp_path / "calls.jsonl").exists()
    assert zipfile.is_zipfile(tmp_path / "transcripts.zip")
    assert Batch.objects.count() == 4  # the Idempotency-Key example made one
