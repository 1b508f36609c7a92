"""The test set-up itself: RECALL_REQUIRE_POSTGRES guards against PostgreSQL-only
tests silently not running, and only against that."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_ONLY = "tests/worker/test_worker_live.py"


def collect(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "RECALL_REQUIRE_POSTGRES": "1",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "SECRET_KEY": secrets.token_urlsafe(50),
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", POSTGRES_ONLY, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_require_postgres_refuses_a_sqlite_run_of_postgres_only_tests(tmp_path):
    result = collect(tmp_path=tmp_path)

    assert result.returncode == 4  # usage error
    assert "PostgreSQL-only tests would not run" in result.stderr


def test_require_postgres_allows_deselecting_them_on_purpose(tmp_path):
    # What scripts/test.sh's SQLite pass does, with RECALL_REQUIRE_POSTGRES=1 in CI.
    result = collect("-m", "not postgres", tmp_path=tmp_path)

    assert result.returncode == 5, result.stdout + result.stderr  # all deselected
    assert "deselected" in result.stdout
