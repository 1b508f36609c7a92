"""Production settings: `check --deploy` is clean, and nothing insecure is defaulted."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.settings import PRODUCTION, ROOT, manage


def test_check_deploy_is_clean_in_production_settings():
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_production_refuses_to_start_without_a_secret_key():
    env = {k: v for k, v in PRODUCTION.items() if k != "SECRET_KEY"}

    result = manage("check", env=env)

    assert result.returncode != 0
    assert "Set SECRET_KEY in the environment" in result.stderr


def test_a_weak_secret_key_is_refused_at_start_up():
    for key, why in (
        ("x" * 20 + "abcdefghij", "it has 30 characters; at least 50 are needed"),
        (
            "django-insecure-" + "abcdefghij" * 5,
            "it starts with Django's 'django-insecure-' prefix",
        ),
        ("ab" * 30, "it has fewer than 5 different characters"),
    ):
        result = manage("check", env={**PRODUCTION, "SECRET_KEY": key})

        assert result.returncode != 0
        assert f"SECRET_KEY is too weak: {why}" in result.stderr


def test_a_weak_secret_key_is_allowed_in_debug():
    env = {**PRODUCTION, "SECRET_KEY": "short", "DEBUG": "on"}

    result = manage("check", env=env)

    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout


def test_the_embedded_set_up_keeps_its_key_in_var(tmp_path):
    # No SECRET_KEY, no DATABASE_URL: what `make run` and every manage.py command
    # on the same checkout see. The key is made once (mode 600) and then shared.
    env = {"PATH": os.environ["PATH"], "RECALL_VAR_DIR": str(tmp_path)}
    show = "from django.conf import settings; print(settings.SECRET_KEY)"

    first = manage("shell", "-v", "0", "-c", show, env=env)
    second = manage("shell", "-v", "0", "-c", show, env=env)

    assert first.returncode == 0, first.stderr
    key_file = tmp_path / "secret_key"
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    key = key_file.read_text().strip()
    assert len(key) >= 50
    assert first.stdout.strip() == second.stdout.strip() == key


def test_the_key_file_is_not_used_with_another_database(tmp_path):
    (tmp_path / "secret_key").write_text(
        "k" * 30 + "-a-long-random-production-secret-value"
    )
    env = {
        "PATH": os.environ["PATH"],
        "RECALL_VAR_DIR": str(tmp_path),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'other.sqlite3'}",
    }

    result = manage("check", env=env)

    assert result.returncode != 0
    assert "Set SECRET_KEY in the environment" in result.stderr


SHOW_DATABASE = (
    "import json; from django.conf import settings; d = settings.DATABASES['default']; "
    "print(json.dumps({'pool': d['OPTIONS'].get('pool'), 'age': d['CONN_MAX_AGE'], "
    "'cursors': not d.get('DISABLE_SERVER_SIDE_CURSORS', False)}))"
)


def database_settings(**env: str) -> dict:
    result = manage("shell", "-v", "0", "-c", SHOW_DATABASE, env={**PRODUCTION, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_web_servers_threads_keep_persistent_connections_not_a_pool():
    # A pool would wait out psycopg-pool's reconnect backoff after a database
    # restart; each thread's own connection is health-checked and reopened.
    threaded = database_settings(
        DATABASE_URL="postgres://recall@db.example.com/recall",
        RECALL_WEB_THREADS="8",
        CONN_MAX_AGE="600",
    )

    assert threaded == {"pool": None, "age": 600, "cursors": True}


def test_commands_and_the_cluster_keep_a_persistent_connection():
    plain = database_settings(DATABASE_URL="postgres://recall@db.example.com/recall")

    assert plain == {"pool": None, "age": 60, "cursors": True}


def test_server_side_cursors_can_be_turned_off_for_transaction_pooling():
    behind_pgbouncer = database_settings(
        DATABASE_URL="postgres://recall@pgbouncer.example.com/recall",
        DATABASE_DISABLE_SERVER_SIDE_CURSORS="on",
    )

    assert behind_pgbouncer == {"pool": None, "age": 60, "cursors": False}


def test_sqlite_never_gets_a_pool():
    sqlite = database_settings(RECALL_WEB_THREADS="8")

    assert sqlite == {"pool": None, "age": 60, "cursors": True}


def test_gunicorn_runs_threads():
    show = (
        "import json, os, runpy; c = runpy.run_path('gunicorn.conf.py'); "
        "print(json.dumps([c['worker_class'], c['workers'], c['threads'], "
        "os.environ['RECALL_WEB_THREADS']]))"
    )

    def config(**env: str) -> list:
        result = subprocess.run(
            [sys.executable, "-c", show], cwd=ROOT, env={**PRODUCTION, **env},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    cores = os.cpu_count() or 1
    threaded = "recall_site.gunicorn_worker.ThreadWorker"
    assert config() == [threaded, cores + 1, 8, "8"]
    assert config(WEB_CONCURRENCY="3", RECALL_WEB_THREADS="4") == [threaded, 3, 4, "4"]
    assert config(RECALL_WEB_THREADS="1") == ["sync", cores + 1, 1, "1"]


def test_gunicorn_workers_freeze_their_start_up_objects():
    # The hook as a worker runs it, once Recall is loaded: the views are
    # imported and every object so far is out of the collector's reach.
    run_hook = (
        "import gc, runpy, sys, django; django.setup(); "
        "c = runpy.run_path('gunicorn.conf.py'); "
        "assert gc.get_freeze_count() == 0 and 'api.worker_views' not in sys.modules; "
        "c['post_worker_init'](None); "
        "print(gc.get_freeze_count(), 'api.worker_views' in sys.modules, "
        "len(gc.get_objects()) < 100)"
    )
    result = subprocess.run(
        [sys.executable, "-c", run_hook], cwd=ROOT,
        env={**PRODUCTION, "DJANGO_SETTINGS_MODULE": "recall_site.settings"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    frozen, views, left = result.stdout.split()
    assert int(frozen) > 10_000
    assert (views, left) == ("True", "True")


SHOW_RETENTION = (
    "from django.conf import settings; print(settings.RECALL_RETENTION_DAYS, "
    "settings.RECALL_RETENTION_PURGE_PER_SWEEP)"
)


@pytest.mark.parametrize(
    ("value", "shown"), [(None, "None 10000"), ("", "None 10000"), ("90", "90.0 10000")]
)
def test_retention_is_off_unless_set(value, shown):
    env = (
        {**PRODUCTION}
        if value is None
        else {**PRODUCTION, "RECALL_RETENTION_DAYS": value}
    )
    result = manage("shell", "-v", "0", "-c", SHOW_RETENTION, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == shown


@pytest.mark.parametrize("value", ["-1", "nan", "ninety", "inf"])
def test_a_bad_retention_is_refused_at_start_up(value):
    result = manage("check", env={**PRODUCTION, "RECALL_RETENTION_DAYS": value})
    assert result.returncode != 0
    assert "RECALL_RETENTION_DAYS must be a number of days" in result.stderr


SHOW_WORKER_LIMITS = (
    "from django.conf import settings; print(settings.RECALL_WORKER_RATE_PER_SECOND, "
    "settings.RECALL_WORKER_RATE_BURST, "
    "settings.RECALL_MAX_WAITING_CLAIMS_PER_WORKER)"
)


def test_one_worker_is_limited_by_default():
    result = manage("shell", "-v", "0", "-c", SHOW_WORKER_LIMITS, env=PRODUCTION)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "100.0 200 4"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("RECALL_WORKER_RATE_PER_SECOND", "-1", "a number of requests, 0 or more"),
        ("RECALL_WORKER_RATE_PER_SECOND", "nan", "a number of requests, 0 or more"),
        ("RECALL_WORKER_RATE_PER_SECOND", "inf", "a number of requests, 0 or more"),
        ("RECALL_WORKER_RATE_PER_SECOND", "fast", "a number of requests, 0 or more"),
        ("RECALL_WORKER_RATE_BURST", "0", "1 to 1,000,000"),
        ("RECALL_WORKER_RATE_BURST", "10000000", "1 to 1,000,000"),
        ("RECALL_MAX_WAITING_CLAIMS_PER_WORKER", "-1", "must not be negative"),
    ],
)
def test_bad_worker_limits_are_refused_at_start_up(name, value, message):
    result = manage("check", env={**PRODUCTION, name: value})
    assert result.returncode != 0
    assert f"{name} must " in result.stderr
    assert message in result.stderr
