"""The README's quick start, run as printed, as a new user would run it.

The commands are read from README.md (so the test follows the README, not a
copy of it) and run in a fresh copy of the checkout (what a clone holds: no
var/, no .env), in a fresh environment (no SECRET_KEY, DATABASE_URL, RECALL_* or
DJANGO_* variable), against a running `make run`. The only change to any line is
the worker token the README asks the reader to paste in place of ``<token>``.

To keep it fast and offline, the copy's ``.venv`` is this test run's virtualenv
(`make run` then finds its dependencies installed). To run the lines with their
own address, 127.0.0.1:8000, whatever else listens there on this machine, every
process runs in a private network namespace (``unshare -n``, as root); where
that is not possible, the address is replaced by a free port.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.server import ROOT, free_port

README_ADDRESS = "127.0.0.1:8000"

pytestmark = pytest.mark.slow


def quick_start() -> tuple[list[str], list[str], str]:
    """The quick start's two code blocks (lines) and its createsuperuser command."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = [
        [line for line in block.strip().splitlines() if line.strip()]
        for block in re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    ]
    (login,) = re.findall(r"`(\S+ manage\.py createsuperuser)`", section)
    first, second = blocks
    return first, second, login


def fresh_copy(destination: Path) -> Path:
    """What a clone of this checkout holds (tracked files, and new ones not
    ignored), with this run's virtualenv as its .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not source.is_file():  # deleted in the working tree
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)  # mtimes kept: make sees the venv up to date
    (destination / ".venv").symlink_to(Path(sys.prefix))
    return destination


def fresh_environment(home: Path) -> dict[str, str]:
    path = os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if not p.startswith(sys.prefix)
    )
    return {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8"}


class Sandbox:
    """Runs commands in the copy, in the fresh environment, in a private network
    namespace when possible (else with README_ADDRESS replaced by a free port)."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env = root, env
        self.holder: subprocess.Popen | None = None
        self.address = README_ADDRESS
        self.prefix: list[str] = []
        holder = (
            subprocess.Popen(
                [
                    "unshare",
                    "-n",
                    "sh",
                    "-c",
                    "ip link set lo up && echo up && exec sleep 600",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            if shutil.which("unshare") and shutil.which("ip")
            else None
        )
        if holder is not None and holder.stdout.readline().strip() == b"up":
            self.holder = holder
            self.prefix = ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"]
        else:
            if holder is not None:
                holder.kill()
                holder.wait()
            self.address = f"127.0.0.1:{free_port()}"
            self.env = {**env, "RECALL_BIND": self.address}

    def line(self, line: str) -> str:
        return line.replace(README_ADDRESS, self.address)

    def start(self, line: str, log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(
                [*self.prefix, "bash", "-c", self.line(line)],
                cwd=self.root,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def run(self, line: str, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [*self.prefix, "bash", "-c", self.line(line)],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            **kwargs,
        )
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        return result

    def http(self, script: str, *args: str) -> dict:
        """Run a small urllib script where the server is; it prints JSON."""
        result = subprocess.run(
            [*self.prefix, sys.executable, "-c", script, self.address, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def close(self) -> None:
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()


def stop(process: subprocess.Popen, sig: int = signal.SIGINT) -> int:
    """Stop what a line started (its whole process group) as Ctrl-C would."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


def wait_until(condition, *, timeout: float, what: str, logs: list[Path]):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            text = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')}" for p in logs
            )
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{text}")
        time.sleep(0.2)


def create_superuser(sandbox: Sandbox, line: str, username: str, password: str) -> str:
    """Run the README's createsuperuser line on a terminal, answering its prompts."""
    answers = [
        (b"Username", username),
        (b"Email address", f"{username}@example.com"),
        (b"Password:", password),
        (b"Password (again)", password),
    ]
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [*sandbox.prefix, "bash", "-c", sandbox.line(line)],
        cwd=sandbox.root,
        env={**sandbox.env, "TERM": "dumb"},
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        start_new_session=True,
    )
    os.close(secondary)
    seen = b""
    try:
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the command exited and closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            if answers and answers[0][0] in seen.rsplit(b"\n", 1)[-1]:
                os.write(primary, answers.pop(0)[1].encode() + b"\n")
        assert process.wait(timeout=60) == 0, seen.decode(errors="replace")
    finally:
        os.close(primary)
    return seen.decode(errors="replace")


LOGIN_AND_PROGRESS = r"""
import http.cookiejar, json, re, sys, urllib.parse, urllib.request
address, username, password, batch = sys.argv[1:]
base = f"http://{address}"
jar = http.cookiejar.CookieJar()
opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
page = opener.open(f"{base}/accounts/login/").read().decode()
csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
form = urllib.parse.urlencode(
    {"username": username, "password": password, "csrfmiddlewaretoken": csrf}
).encode()
landed = opener.open(urllib.request.Request(
    f"{base}/accounts/login/", data=form, headers={"Referer": f"{base}/accounts/login/"}
))
progress = json.load(opener.open(f"{base}/batches/{batch}/progress.json"))
session = next(c.value for c in jar if c.name == "sessionid")
print(json.dumps({"landed": landed.url, "progress": progress, "session": session}))
"""

HEALTHZ = r"""
import json, sys, urllib.request
try:
    with urllib.request.urlopen(f"http://{sys.argv[1]}/healthz", timeout=2) as r:
        print(json.dumps({"status": r.status}))
except OSError as error:
    print(json.dumps({"status": str(error)}))
"""


def test_the_readme_quick_start_works_as_printed(tmp_path):
    first, second, login = quick_start()
    assert first[0].split("#")[0].strip() == "make run"
    assert first[1].split("#")[0].strip() == "make test"  # this very suite: not rerun
    root = fresh_copy(tmp_path / "recall")
    home = tmp_path / "home"
    home.mkdir()
    sandbox = Sandbox(root, fresh_environment(home))
    run_log, worker_log = tmp_path / "make-run.log", tmp_path / "worker.log"
    server = worker = None
    try:
        server = sandbox.start(first[0], run_log)
        wait_until(
            lambda: sandbox.http(HEALTHZ)["status"] == 200,
            timeout=120,
            what="`make run` to serve",
            logs=[run_log],
        )
        assert (
            "No user yet: create one with   .venv/bin/python manage.py createsuperuser"
            in run_log.read_text()
        )

        # "Create a login with `.venv/bin/python manage.py createsuperuser`".
        password = secrets.token_urlsafe(12)
        create_superuser(sandbox, login, "ana", password)

        # "Then, in another terminal": the second block, line by line.
        create_worker, write_manifest, create_batch, start_worker = second
        token = sandbox.run(create_worker).stdout.strip().splitlines()[-1]
        sandbox.run(write_manifest)
        assert not (root / "manifest.txt").exists()  # not into the checkout
        batch = int(sandbox.run(create_batch).stdout.strip().splitlines()[-1])
        assert "<token>" in start_worker
        worker = sandbox.start(start_worker.replace("<token>", token), worker_log)

        def finished() -> dict | None:
            seen = sandbox.http(LOGIN_AND_PROGRESS, "ana", password, str(batch))
            return seen if seen["progress"]["counts"]["done"] == 2 else None

        seen = wait_until(
            finished, timeout=60, what="both items done", logs=[run_log, worker_log]
        )
        # The README: "a login lands on the overview".
        assert seen["landed"] == f"http://{sandbox.address}/overview/"
        assert seen["progress"]["state"] == "finished"

        # The commands used the server's own key: a session the server signed
        # decodes in a command (with another key it would decode as empty).
        decoded = sandbox.run(
            ".venv/bin/python manage.py shell -v 0 -c "
            '"from django.contrib.sessions.backends.db import SessionStore; '
            f"print(SessionStore('{seen['session']}').load()['_auth_user_id'])\""
        )
        user_id = sandbox.run(
            ".venv/bin/python manage.py shell -v 0 -c "
            '"from django.contrib.auth.models import User; '
            "print(User.objects.get(username='ana').pk)\""
        )
        assert decoded.stdout.strip() == user_id.stdout.strip()
        key_file = root / "var" / "secret_key"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        assert (
            sandbox.run(".venv/bin/python manage.py recall_check")
            .stdout.strip()
            .endswith("recall_check: ok, no violations")
        )

        assert stop(worker, signal.SIGTERM) == 0, worker_log.read_text()
        worker = None
        stop(server)  # Ctrl-C
        server = None
        assert "Traceback" not in run_log.read_text()
    finally:
        for process in (worker, server):
            if process is not None:
                with contextlib.suppress(Exception):
                    stop(process, signal.SIGKILL)
        sandbox.close()
