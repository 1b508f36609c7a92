"""Production settings: `check --deploy` is clean, and nothing insecure is defaulted."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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


def test_check_deploy_is_clean_in_production_settings():
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_production_refuses_to_start_without_a_secret_key():
    env = {k: v for k, v in PRODUCTION.items() if k != "SECRET_KEY"}

    result = manage("check", env=env)

    assert result.returncode != 0
    assert "Set SECRET_KEY in the environment" in result.stderr
