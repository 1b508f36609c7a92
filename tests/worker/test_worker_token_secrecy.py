"""An engine runs as the worker's user; it must not get the worker's token out
of the worker's process: not from /proc/<worker>/environ (the kernel's copy of
the environment the worker started with, which os.environ changes do not
rewrite), its threads' environ, cmdline, maps or mem. The reference worker runs
against the live server with the token in its environment and a real engine
that tries all of these. Linux only.

Run as root (as CI does), the worker is started once as root, whom nothing
keeps out of /proc, so there the environment block itself must be scrubbed,
and once as an unprivileged user (nobody), where the files must be closed to
the engine altogether.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from django.utils import timezone

from engine.manifests import create_batch
from jobs.models import Job, JobStatus
from tests.support.factories import make_worker
from tests.support.worker import WORKER_SCRIPT, wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's"
    ),
]

NOBODY = 65534

# The engine: reads what it can of its parent (the worker) and reports it.
PROBE = r"""
import json, os

out, parent = os.environ["PROBE_DIR"], os.getppid()
report = {"parent": parent}


def grab(name, path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        report[name] = type(error).__name__
        return
    report[name] = "read"
    with open(os.path.join(out, name + ".bin"), "wb") as f:
        f.write(data)


grab("environ", f"/proc/{parent}/environ")
grab("cmdline", f"/proc/{parent}/cmdline")
grab("maps", f"/proc/{parent}/maps")
try:
    threads = sorted(os.listdir(f"/proc/{parent}/task"))
except OSError as error:
    threads, report["task"] = [], type(error).__name__
for tid in threads:
    grab(f"task-{tid}-environ", f"/proc/{parent}/task/{tid}/environ")
try:
    with open(f"/proc/{parent}/mem", "rb"):
        report["mem"] = "opened"
except OSError as error:
    report["mem"] = type(error).__name__
grab("own-environ", "/proc/self/environ")
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print(json.dumps({"text": "probed"}))
"""


def python_for(uid: int | None) -> str | None:
    """A Python 3.11+ that ``uid`` may run (the worker needs nothing else)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(candidate):
            continue
        try:
            check = subprocess.run(
                [candidate, "-c", "import sys; assert sys.version_info >= (3, 11)"],
                user=uid,
                capture_output=True,
                timeout=30,
            )
        except PermissionError:  # the user may not even start it
            continue
        if check.returncode == 0:
            return candidate
    return None


@pytest.fixture
def probe_dir():
    """A directory any user can write, holding the probe engine."""
    directory = Path(tempfile.mkdtemp(prefix="recall-probe-"))
    directory.chmod(0o777)
    probe = directory / "probe.py"
    probe.write_text(PROBE)
    probe.chmod(0o644)
    yield directory
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()


def run_worker_with_probe(live_server, directory: Path, *, uid: int | None):
    """Start the worker as ``uid`` (None: as this process) on a one-item
    batch, wait until the probe engine's job is completed, and return what the
    probe found, with the token and the worker's pid."""
    python = python_for(uid)
    if python is None:
        pytest.skip("no Python 3.11 this user may run")
    worker = make_worker(f"gpu-probe-{uid}")
    create_batch("probe", lambda: iter(["/audio/probe.wav\n"]), now=timezone.now())
    env = {
        k: v
        for k, v in os.environ.items()
        if "proxy" not in k.lower() and not k.startswith("RECALL_")
    }
    env.update(
        RECALL_URL=live_server.url,
        RECALL_TOKEN=worker.token,
        PROBE_DIR=str(directory),
        HOME=str(directory),
    )
    log_path = directory / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                python,
                str(WORKER_SCRIPT),
                "--poll-min=0.1",
                "--poll-max=0.3",
                "--retry-max=0.5",
                "--http-timeout=5",
                f"--workdir={directory}",
                "--command",
                f"{python} {directory / 'probe.py'}",
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=uid,
            group=uid,
            extra_groups=[] if uid is not None else None,
        )
    try:
        wait_for(
            lambda: Job.objects.filter(
                batch__name="probe", status=JobStatus.COMPLETED
            ).exists(),
            timeout=60,
            what=f"the probe's job to complete\n{log_path.read_text()}",
        )
        # Still running, so what root sees of it now is what it holds.
        root_view = Path(f"/proc/{proc.pid}/environ").read_bytes()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = json.loads((directory / "report.json").read_text())
    assert report["parent"] == proc.pid  # the probe looked at the worker
    dumps = {p.stem: p.read_bytes() for p in directory.glob("*.bin")}
    return worker.token, report, dumps, root_view


def test_an_engine_cannot_read_the_token_as_root_sees_it(live_server, probe_dir):
    """As root nothing keeps the engine out of /proc: the environment block
    must hold no token any more."""
    if os.geteuid() != 0:
        pytest.skip("this run is not root: see the unprivileged case")
    token, report, dumps, root_view = run_worker_with_probe(
        live_server, probe_dir, uid=None
    )

    assert report["environ"] == "read"  # root may, and did
    assert token.encode() not in root_view
    assert b"RECALL_TOKEN=\0" in root_view  # the entry's value is zeroed
    assert dumps, "the probe read nothing"
    for name, data in dumps.items():
        assert token.encode() not in data, name
    assert b"RECALL_TOKEN" not in dumps["own-environ"]  # never inherited


def test_an_unprivileged_engine_cannot_read_its_workers_token(live_server, probe_dir):
    """The worker and its engine run as an ordinary user: the worker's
    environ, maps and mem are closed to the engine, and nothing it can read
    holds the token."""
    uid = NOBODY if os.geteuid() == 0 else None  # None: already unprivileged
    token, report, dumps, _ = run_worker_with_probe(live_server, probe_dir, uid=uid)

    assert report["environ"] == "PermissionError"
    assert report["maps"] == "PermissionError"
    assert report["mem"] == "PermissionError"
    threads = [k for k in report if k.startswith("task-")]
    assert threads
    assert all(report[k] == "PermissionError" for k in threads)
    assert report["cmdline"] == "read"  # world-readable: it holds no token
    for name, data in dumps.items():
        assert token.encode() not in data, name
    assert b"RECALL_TOKEN" not in dumps["own-environ"]
    assert stat.S_IMODE(probe_dir.stat().st_mode) == 0o777


def test_a_token_on_the_command_line_is_warned_about(live_server, tmp_path):
    worker = make_worker("gpu-argv")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECALL_")}
    env["RECALL_URL"] = live_server.url
    logs, pids = [], []
    for how in ("argv", "env"):
        args = ["--token", worker.token] if how == "argv" else []
        run_env = env if how == "argv" else {**env, "RECALL_TOKEN": worker.token}
        log_path = tmp_path / f"{how}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT), "--simulate", *args],
                env=run_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_for(
                lambda path=log_path: "recall-worker" in path.read_text(),
                what="the worker's start-up line",
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
        logs.append(log_path.read_text())
        pids.append(proc.pid)

    assert (
        f"the token is on the command line, where every user of this machine can "
        f"read it (/proc/{pids[0]}/cmdline): use RECALL_TOKEN or --token-file"
    ) in logs[0]
    assert "command line" not in logs[1]
    assert worker.token not in logs[0] + logs[1]
