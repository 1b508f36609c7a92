"""The real server on the test database, for the tests: gunicorn with
gunicorn.conf.py through the harness (``harness/server.py``), its database
the one pytest-django made (PostgreSQL, or the embedded SQLite file)."""

from __future__ import annotations

import os
import subprocess

from django.db import connection

from harness.server import ROOT, Server, healthy

__all__ = [
    "APPLICATION",
    "ROOT",
    "backends",
    "healthy",
    "served_database_url",
    "start_server",
]

# The application name of the server's connections, to tell them from any other.
APPLICATION = "recall-server-test"


def start_server(
    tmp_path, processes: int, threads: int, *args: str, env: dict | None = None
) -> tuple[subprocess.Popen, int, object]:
    """gunicorn with gunicorn.conf.py (``args`` and ``env`` on top) on the test
    database, serving once ``processes`` have booted: (its master, port, log
    path)."""
    server = Server(
        {
            "PATH": os.environ["PATH"],
            "SECRET_KEY": os.environ["SECRET_KEY"],
            "DATABASE_URL": served_database_url(),
            "RECALL_HTTPS": "off",
            "RECALL_STARTUP_SWEEP": "quick",
            "RECALL_VAR_DIR": str(tmp_path),
            "WEB_CONCURRENCY": str(processes),
            "RECALL_WEB_THREADS": str(threads),
            "RECALL_ACCESS_LOG": str(tmp_path / "access.log"),
            **(env or {}),
        },
        tmp_path / "gunicorn.log",
        args=args,
    )
    server.wait_until_up(booted=processes)
    assert server.popen is not None
    return server.popen, server.port, server.log


def served_database_url(application: str = APPLICATION) -> str:
    """The test database as a server's DATABASE_URL."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    # Named, to tell its connections from any other (a live server's).
    return (
        f"postgres://{s['USER'] or 'root'}@{s['HOST'] or '127.0.0.1'}:"
        f"{s['PORT'] or 5432}/{s['NAME']}?application_name={application}"
    )


def backends() -> int:
    """The server's connections to the test database."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [APPLICATION],
        )
        return cursor.fetchone()[0]
