"""recallctl against a live Recall server: a pipeline submits a manifest and
waits while the reference worker (a real subprocess, simulated engine) drains
the batch, then exports it; failures, cancels and errors give their exit
statuses and one readable line."""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batches.models import Batch
from jobs.models import Event
from operator_api import tokens
from tests.support.factories import make_user, make_worker
from tests.support.worker import FAKE_ENGINE_COMMAND, ROOT

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

RECALLCTL = ROOT / "worker" / "recallctl.py"


@pytest.fixture(autouse=True)
def _quick_retries(settings):
    settings.RECALL_RETRY_BACKOFF_SECONDS = 0


@pytest.fixture
def api_token(db) -> str:
    from jobs import transitions

    user = make_user("pipeline", "Operators")
    _, token = tokens.issue_token(user, label="ci", now=transitions.now())
    return token


@pytest.fixture
def recallctl(live_server, api_token):
    def run(*args: str, token: str | None = None, timeout: float = 60):
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(RECALL_URL=live_server.url, RECALL_API_TOKEN=token or api_token)
        return subprocess.run(
            [sys.executable, str(RECALLCTL), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


def _manifest(tmp_path: Path, rows: list[str], name: str = "calls.csv") -> Path:
    path = tmp_path / name
    path.write_text("".join(f"{row}\n" for row in rows))
    return path


def test_submit_wait_and_export_while_a_worker_drains_the_batch(
    recallctl, start_worker, tmp_path
):
    manifest = _manifest(
        tmp_path,
        ["source,duration_seconds,speaker"]
        + [f"/calls/{n}.wav,{2 + n},agent-{n % 2}" for n in range(6)],
    )
    worker = start_worker(
        make_worker("gpu-1"), "--simulate", "--simulate-factor=0.1", "--concurrency=2"
    )

    done = recallctl(
        "submit", str(manifest), "--name", "calls", "--wait", "--interval=0.3"
    )

    assert done.returncode == 0, (done.stdout, done.stderr, worker.log())
    batch = Batch.objects.get()
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"submitted batch {batch.pk} 'calls': running, 0/6 done")
    assert lines[-1].startswith(
        f"batch {batch.pk} 'calls': finished, 6/6 done (100%), 0 in flight"
    )
    assert len(lines) >= 3  # progress lines while it ran
    assert batch.created_by.username == "pipeline"
    assert batch.items.get(source="/calls/1.wav").params == {"speaker": "agent-1"}

    out = tmp_path / "out.csv"
    exported = recallctl("export", str(batch.pk), "--format", "csv", "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [(r["source"], r["state"]) for r in rows] == [
        (f"/calls/{n}.wav", "done") for n in range(6)
    ]
    assert exported.stdout == f"wrote {out} ({out.stat().st_size} bytes)\n"

    # Submitting the same manifest again (a retried pipeline step) is a no-op.
    again = recallctl("submit", str(manifest), "--name", "calls")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[0].startswith(
        f"already submitted (same manifest and name): batch {batch.pk} 'calls'"
    )
    assert again.stdout.splitlines()[-1] == str(batch.pk)
    assert Batch.objects.count() == 1

    status = recallctl("status", str(batch.pk))
    assert status.stdout.startswith(f"batch {batch.pk} 'calls': finished, 6/6 done")


def test_a_batch_submitted_with_require_goes_only_to_workers_offering_it(
    recallctl, start_worker, tmp_path
):
    manifest = _manifest(tmp_path, [f"/lectures/{n}.wav" for n in range(4)])
    large = start_worker(
        make_worker("gpu-large"),
        "--simulate",
        "--simulate-factor=0.01",
        "--concurrency=2",
        "--label=model=large-v3",
        "--label=gpu=a100",
    )
    small = start_worker(make_worker("cpu-small"), "--simulate", "--label=gpu=none")

    done = recallctl(
        "submit",
        str(manifest),
        "--name",
        "lectures",
        "--require",
        "model=large-v3",
        "--wait",
        "--interval=0.3",
    )

    assert done.returncode == 0, (done.stdout, done.stderr, large.log(), small.log())
    batch = Batch.objects.get()
    assert batch.requires == {"model": "large-v3"}
    assert set(
        batch.jobs.values_list("leases__worker__name", flat=True).distinct()
    ) == {"gpu-large"}

    refused = recallctl("submit", str(manifest), "--require", "Model=large")
    assert refused.returncode == 4
    assert refused.stderr.startswith("recallctl: error: --require was refused: ")
    assert Batch.objects.count() == 1


def test_wait_exits_1_when_items_failed_and_retry_queues_them(
    recallctl, start_worker, tmp_path
):
    manifest = _manifest(
        tmp_path, ["source,mode", "/a.wav,json", "/b.wav,exit:3", "/c.wav,json"]
    )
    start_worker(make_worker("gpu-1"), f"--command={FAKE_ENGINE_COMMAND}")

    waited = recallctl("submit", str(manifest), "--wait", "--interval=0.3")

    assert waited.returncode == 1, (waited.stdout, waited.stderr)
    batch = Batch.objects.get()
    assert waited.stdout.splitlines()[-1].startswith(
        f"batch {batch.pk} 'calls': finished, 2/3 done (66.7%), 1 failed"
    )
    retried = recallctl("retry", str(batch.pk), "--source-contains", "b.wav")
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.startswith("queued 1 failed item(s) again; ")
    assert (
        Event.objects.filter(
            kind=Event.Kind.RETRIED, actor__username="pipeline"
        ).count()
        == 1
    )


def test_wait_exits_2_when_the_batch_is_cancelled(recallctl, tmp_path):
    manifest = _manifest(tmp_path, ["/a.wav", "/b.wav"], name="plain.txt")
    submitted = recallctl("submit", str(manifest))
    batch_id = submitted.stdout.splitlines()[-1]
    assert submitted.returncode == 0 and batch_id == str(Batch.objects.get().pk)

    cancelled = recallctl("cancel", batch_id)
    assert cancelled.returncode == 0
    assert cancelled.stdout.startswith(
        f"cancelled 2 item(s); batch {batch_id} 'plain': cancelled"
    )

    waited = recallctl("wait", batch_id, "--interval=0.1")
    assert waited.returncode == 2
    assert waited.stdout.startswith(f"batch {batch_id} 'plain': cancelled")


def test_errors_are_one_line_and_exit_4(recallctl, tmp_path, live_server):
    worker = make_worker("gpu-1")

    refused = recallctl("status", "1", token=worker.token)
    assert (refused.returncode, refused.stdout) == (4, "")
    assert refused.stderr == (
        "recallctl: error: 401 unauthorized: This is not an API token (they start "
        "with 'rct_'); worker tokens are refused here.\n"
    )

    missing = recallctl("status", "999")
    assert missing.stderr == "recallctl: error: 404 not_found: There is no batch 999.\n"

    bad = recallctl(
        "submit", str(_manifest(tmp_path, ["/ok.wav", "-rf"], name="bad.txt"))
    )
    assert bad.returncode == 4
    assert bad.stderr.startswith(
        "recallctl: error: the manifest was refused: 1 problem(s) with the items; "
        "nothing was created. items[1]: the source starts with '-'"
    )
    assert bad.stderr.count("\n") == 1
    assert Batch.objects.count() == 0

    usage = recallctl("export", "1", "--format", "xml", "-o", "x")
    assert usage.returncode == 4 and "invalid choice: 'xml'" in usage.stderr

    nowhere = subprocess.run(
        [sys.executable, str(RECALLCTL), "--url", "http://127.0.0.1:9", "status", "1"],
        env={"RECALL_API_TOKEN": "rct_x", "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert nowhere.returncode == 4
    assert nowhere.stderr.startswith(
        "recallctl: error: cannot reach http://127.0.0.1:9"
    )


def test_wait_says_when_the_batch_waits_for_a_retry_backoff(
    recallctl, settings, worker
):
    """Issue 27, item 8: the last item waits out its backoff; recallctl says
    so instead of an ETA."""
    from jobs import transitions
    from tests.support.factories import claim, make_batch

    settings.RECALL_RETRY_BACKOFF_SECONDS = 30
    batch = make_batch(2, name="calls", now=transitions.now())
    done = claim(worker, now=transitions.now())
    transitions.complete(done, done.lease_token, worker=worker, result={"text": "x"})
    failed = claim(worker, now=transitions.now())
    transitions.fail(failed, failed.lease_token, worker=worker, error="GPU hiccup")

    shown = recallctl("status", str(batch.pk))

    assert shown.returncode == 0, shown.stderr
    assert re.fullmatch(
        rf"batch {batch.pk} 'calls': running, 1/2 done \(50%\), 0 in flight, "
        r"1 waiting to retry in (29|30)s\n",
        shown.stdout,
    ), shown.stdout
