"""Fixtures. Tests run against a real database: PostgreSQL (DATABASE_URL=
postgres://...) or the embedded SQLite.

Tests marked ``postgres`` need PostgreSQL: elsewhere they are skipped, unless
RECALL_REQUIRE_POSTGRES=1, which makes a non-PostgreSQL run an error instead (CI
sets it, so a missing server cannot pass silently).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import datetime

import pytest

from api import worker_limits
from batches.models import Batch
from jobs.models import Worker
from jobs.transitions import choice
from tests.support.factories import (
    T0,
    WorkerClient,
    is_postgres,
    make_batch,
    make_user,
    make_worker,
)
from tests.support.receiver import Receiver


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # trylast: after `-m` has deselected what this run is not meant to run (the
    # SQLite pass deselects the PostgreSQL-only tests on purpose).
    if is_postgres():
        return
    needs_pg = [item for item in items if item.get_closest_marker("postgres")]
    if needs_pg and os.environ.get("RECALL_REQUIRE_POSTGRES") == "1":
        raise pytest.UsageError(
            "RECALL_REQUIRE_POSTGRES=1 but DATABASE_URL is not PostgreSQL: "
            f"{len(needs_pg)} PostgreSQL-only tests would not run."
        )
    skip = pytest.mark.skip(reason="needs PostgreSQL (set DATABASE_URL=postgres://...)")
    for item in needs_pg:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_worker_limits():
    """Each test starts with no request counted and no claim waiting for any
    worker (ids repeat across tests: counts must not)."""
    worker_limits.clear()


@pytest.fixture(autouse=True)
def _fresh_transition_backends():
    """Each test's claims start as a new process's would: a connection's
    backend keeps what its claims learned (which label sets claim without a
    rival batch), and the test database's connection outlives the test."""
    choice.forget()


@pytest.fixture(autouse=True)
def _test_settings(settings):
    """Static files are not collected for tests: serve them from the sources."""
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {
            "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        },
    }


@pytest.fixture
def now() -> datetime:
    """A fixed 'now': tests pass time explicitly instead of sleeping."""
    return T0


@pytest.fixture
def worker(db) -> Worker:
    return make_worker("gpu-1")


@pytest.fixture
def other_worker(db) -> Worker:
    return make_worker("gpu-2")


@pytest.fixture
def batch(db) -> Batch:
    return make_batch(3)


# Operators' accounts, by the group that gives them their rights (the UI and
# the operator API check the same roles).
@pytest.fixture
def viewer(db):
    return make_user("viewer", "Viewers")


@pytest.fixture
def operator(db):
    return make_user("operator", "Operators")


@pytest.fixture
def superuser_client(django_user_model, client):
    """The test client, logged in as a superuser (the admin's pages)."""
    client.force_login(django_user_model.objects.create_superuser("root-admin"))
    return client


@pytest.fixture
def stranger(db):
    """Logged in, but in no group: may see nothing."""
    return make_user("stranger")


@pytest.fixture
def api(worker) -> WorkerClient:
    return WorkerClient(worker)


@pytest.fixture
def other_api(other_worker) -> WorkerClient:
    return WorkerClient(other_worker)


@pytest.fixture
def receiver(settings) -> Iterator[Receiver]:
    """A real webhook receiver on 127.0.0.1 (which only
    RECALL_WEBHOOK_ALLOW_PRIVATE=on lets Recall send to)."""
    settings.RECALL_WEBHOOK_ALLOW_PRIVATE = True
    receiver = Receiver()
    yield receiver
    receiver.close()
