"""LOG_FORMAT=json: every line one JSON object, with the lease ids a record
carries; the same for the commands and the django-q2 cluster. (gunicorn's own
lines: tests/system/test_gunicorn.py.)"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recall_site.logs import JsonFormatter

ROOT = Path(__file__).resolve().parents[2]


def record(message: str = "claimed", *args, **extra) -> logging.LogRecord:
    made = logging.getLogger("recall.jobs").makeRecord(
        "recall.jobs", logging.INFO, __file__, 1, message, args, None, extra=extra
    )
    made.created = 1_790_000_000.25
    return made


def test_a_record_is_one_json_object_with_the_lease_ids():
    line = JsonFormatter().format(
        record(
            "job %s claimed",
            42,
            job=42,
            attempt=2,
            worker=7,
            batch=3,
            token="never copied",
        )
    )

    assert json.loads(line) == {
        "time": "2026-09-21T14:13:20.250+00:00",
        "level": "INFO",
        "logger": "recall.jobs",
        "message": "job 42 claimed",
        "pid": os.getpid(),
        "job": 42,
        "attempt": 2,
        "worker": 7,
        "batch": 3,
    }


def test_ids_that_are_absent_are_left_out_and_odd_values_survive():
    plain = json.loads(JsonFormatter().format(record("sweep\ndone")))
    odd = json.loads(JsonFormatter().format(record(job=Path("/x"), batch=None)))

    assert set(plain) == {"time", "level", "logger", "message", "pid"}
    assert plain["message"] == "sweep\ndone"
    assert odd["job"] == "/x"
    assert "batch" not in odd


def test_an_exception_is_in_its_own_field():
    try:
        raise ValueError("bad \udcff input")
    except ValueError:
        failed = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )

    line = JsonFormatter().format(failed)

    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "failed"
    assert entry["exception"].startswith("Traceback (most recent call last):")
    assert entry["exception"].endswith("ValueError: bad \udcff input")


def _env(tmp_path: Path, **extra: str) -> dict:
    return {
        "PATH": os.environ["PATH"],
        "SECRET_KEY": "logs-test-secret-" + "x" * 50,
        "RECALL_HTTPS": "off",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'logs.sqlite3'}",
        "LOG_FORMAT": "json",
        **extra,
    }


def _manage(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_commands_log_json_lines_on_stdout(tmp_path):
    env = _env(tmp_path)
    assert _manage(env, "migrate", "-v0").returncode == 0
    emit = (
        "import logging; logging.getLogger('recall.jobs').info("
        "'lease claimed', extra={'job': 5, 'attempt': 1, 'worker': 2, 'batch': 9})"
    )

    shell = _manage(env, "shell", "-v0", "-c", emit)
    sweep = _manage(env, "recall_sweep")

    [line] = shell.stdout.splitlines()
    entry = json.loads(line)
    assert (entry["logger"], entry["message"]) == ("recall.jobs", "lease claimed")
    assert [entry[k] for k in ("job", "attempt", "worker", "batch")] == [5, 1, 2, 9]
    assert shell.stderr == ""
    # The sweep logs one line, then prints its report; the last line stays the
    # command's value.
    first, *_, last = sweep.stdout.splitlines()
    assert json.loads(first)["logger"] == "recall.sweep"
    assert json.loads(last)["reclaimed"] == {"failed": 0, "requeued": 0}


def test_an_unknown_log_format_is_refused(tmp_path):
    result = _manage(_env(tmp_path, LOG_FORMAT="xml"), "check")

    assert result.returncode != 0
    assert "LOG_FORMAT must be one of text, json." in result.stderr


@pytest.mark.slow
def test_the_cluster_logs_json_lines(tmp_path):
    env = _env(tmp_path)
    assert _manage(env, "migrate", "-v0").returncode == 0
    out = tmp_path / "qcluster.log"
    cluster = subprocess.Popen(
        [sys.executable, "manage.py", "qcluster"],
        cwd=ROOT,
        env=env,
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "running." not in out.read_text():
            assert cluster.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
    finally:
        os.killpg(cluster.pid, signal.SIGKILL)
        cluster.wait()

    lines = [json.loads(line) for line in out.read_text().splitlines()]

    assert {line["logger"] for line in lines} == {"django-q"}
    assert len({line["pid"] for line in lines}) >= 3  # the cluster's processes
    assert any(line["message"].endswith("running.") for line in lines)


# --- gunicorn's access lines (recall_site/gunicorn_worker.py, AccessLogger) --------


@pytest.mark.parametrize(
    "format",
    [
        None,  # gunicorn's default, Recall's
        '%(h)s %(l)s %(u)s "%(r)s" %(s)s %(b)s %(B)s "%(f)s" "%(a)s" %(m)s %(U)s '
        "%(q)s %(H)s %(T)s %(D)s %(M)s %(L)s %(p)s %(x)s",
        '%(h)s "%({user-agent}i)s" %({content-type}o)s %({http_host}e)s',
    ],
)
def test_the_access_logger_writes_gunicorns_lines(format):
    """Recall's access logger gathers only the atoms a format can name, and
    writes exactly the line gunicorn's own logger writes."""
    from datetime import timedelta

    from gunicorn import glogging
    from gunicorn.config import Config

    from recall_site.gunicorn_worker import AccessLogger

    class Response:
        status, sent = "200 OK", 123
        headers = [("Content-Type", "application/json"), ("X-Frame-Options", "DENY")]

    class Request:
        headers = [("HOST", "127.0.0.1:8000"), ("USER-AGENT", 'a "quoted" agent')]

    environ = {
        "REMOTE_ADDR": "10.0.0.1", "REQUEST_METHOD": "POST",
        "RAW_URI": "/api/v1/claim?x=1", "SERVER_PROTOCOL": "HTTP/1.1",
        "PATH_INFO": "/api/v1/claim", "QUERY_STRING": "x=1",
        "HTTP_USER_AGENT": 'a "quoted" agent', "HTTP_HOST": "127.0.0.1:8000",
        "HTTP_AUTHORIZATION": "Basic dXNlcjpwdw==", "wsgi.version": (1, 0),
    }  # fmt: skip
    config = Config()
    if format is not None:
        config.set("access_log_format", format)
    took = timedelta(seconds=1, microseconds=2345)

    def line(logger_class) -> str:
        logger = logger_class(config)
        logger.now = lambda: "[03/Dec/2026:07:13:58 +0000]"
        atoms = logger.atoms(Response(), Request(), environ, took)
        return config.access_log_format % glogging.SafeAtoms(atoms)

    assert line(AccessLogger) == line(glogging.Logger)
