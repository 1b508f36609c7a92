"""Production settings in a child process: the environment they are given
and ``manage.py`` run with exactly that environment."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.server import ROOT

PRODUCTION = {
    "PATH": os.environ["PATH"],
    "SECRET_KEY": "k" * 30 + "-a-long-random-production-secret-value",
    "ALLOWED_HOSTS": "recall.example.com",
    "DATABASE_URL": "sqlite:////tmp/recall-settings-test.sqlite3",
}


def manage(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
