"""Small factories and helpers shared by the tests."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.test import Client

from batches.models import Batch, BatchCounter, BatchItem
from engine.manifests import create_batch
from jobs import transitions
from jobs.models import Job, Lease, Worker

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def later(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def make_worker(name: str = "gpu-1") -> Worker:
    worker, token = transitions.create_worker(name)
    worker.token = token
    return worker


def make_batch(
    n: int = 3,
    *,
    name: str = "batch",
    durations: list[float | None] | None = None,
    priority: int = 0,
    languages: list[str | None] | None = None,
    now: datetime = T0,
) -> Batch:
    """``n`` items; ``durations`` (seconds) and ``languages`` (each item's
    ``params.language``, "" for none) give one value per item when set."""
    if durations is None and languages is None:
        lines = [f"file:///audio/{name}-{i}.wav\n" for i in range(n)]
    else:
        n = len(durations if durations is not None else languages or [])
        columns = [("duration_seconds", durations), ("language", languages)]
        given = [(c, v) for c, v in columns if v is not None]
        lines = [",".join(["source", *(c for c, _ in given)]) + "\n"] + [
            ",".join(
                [
                    f"file:///audio/{name}-{i}.wav",
                    *("" if v[i] is None else str(v[i]) for _, v in given),
                ]
            )
            + "\n"
            for i in range(n)
        ]
    return create_batch(name, lambda: iter(lines), priority=priority, now=now)


def jobs_of(batch: Batch) -> list[Job]:
    return list(Job.objects.filter(batch=batch).select_related("item").order_by("pk"))


def snapshot(*jobs: Job) -> dict:
    """Everything a transition may touch, for 'nothing changed' assertions."""
    job_ids = [j.pk for j in jobs]
    batch_ids = sorted({j.batch_id for j in jobs})
    return {
        "jobs": list(Job.objects.filter(pk__in=job_ids).order_by("pk").values()),
        "items": list(
            BatchItem.objects.filter(job__pk__in=job_ids).order_by("pk").values()
        ),
        "leases": list(
            Lease.objects.filter(job__pk__in=job_ids).order_by("pk").values()
        ),
        "counters": list(
            BatchCounter.objects.filter(batch_id__in=batch_ids).order_by("pk").values()
        ),
        "batches": list(Batch.objects.filter(pk__in=batch_ids).order_by("pk").values()),
    }


@contextlib.contextmanager
def failpoint(table: str, on: str = "UPDATE"):
    """Make every ``on`` (INSERT or UPDATE) of ``table`` fail inside the database.

    A real trigger raising a real database error: no mocks.
    """
    name = f"failpoint_{table}_{on.lower()}"
    with connection.cursor() as cursor:
        if is_postgres():
            cursor.execute(
                "CREATE OR REPLACE FUNCTION recall_failpoint() RETURNS trigger AS $$ "
                "BEGIN RAISE EXCEPTION 'failpoint: % on %', TG_OP, TG_TABLE_NAME; END "
                "$$ LANGUAGE plpgsql"
            )
            cursor.execute(
                f"CREATE TRIGGER {name} BEFORE {on} ON {table} "
                f"FOR EACH ROW EXECUTE FUNCTION recall_failpoint()"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER {name} BEFORE {on} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, 'failpoint: {on} on {table}'); END"
            )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            if is_postgres():
                cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
            else:
                cursor.execute(f"DROP TRIGGER IF EXISTS {name}")


class WorkerClient:
    """The worker API as a worker sees it (real HTTP stack via Django's client)."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.client = Client()

    def post(
        self,
        path: str,
        body=None,
        *,
        raw: bytes | None = None,
        token: str | None = None,
    ):
        data = raw if raw is not None else (b"" if body is None else _json(body))
        return self.client.post(
            path,
            data=data,
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {token or self.worker.token}",
        )

    def claim(self):
        return self.post("/api/v1/claim", {})

    def heartbeat(self, job_id: int, token: str):
        return self.post(f"/api/v1/jobs/{job_id}/heartbeat", {"lease_token": token})

    def heartbeat_many(self, leases: list[tuple[int, str]]):
        """One batched heartbeat of (job id, lease token) pairs."""
        return self.post(
            "/api/v1/heartbeat",
            {"leases": [{"job_id": j, "lease_token": t} for j, t in leases]},
        )

    def complete(self, job_id: int, token: str, result=None):
        result = {"text": "hello"} if result is None else result
        return self.post(
            f"/api/v1/jobs/{job_id}/complete", {"lease_token": token, "result": result}
        )

    def complete_many(self, results: list[tuple[int, str, dict]]):
        """One batched completion of (job id, lease token, result) triples."""
        return self.post(
            "/api/v1/complete",
            {
                "results": [
                    {"job_id": j, "lease_token": t, "result": r} for j, t, r in results
                ]
            },
        )

    def fail(
        self, job_id: int, token: str, error: str = "boom", retryable: bool = True
    ):
        return self.post(
            f"/api/v1/jobs/{job_id}/fail",
            {"lease_token": token, "error": error, "retryable": retryable},
        )

    def release(self, job_id: int, token: str):
        return self.post(f"/api/v1/jobs/{job_id}/release", {"lease_token": token})


# A job id no test reaches (the batched worker calls' refusals name it).
NO_SUCH_JOB = 10**12


def claimed_job(api: WorkerClient) -> dict:
    """A job claimed through the worker API (``POST /api/v1/claim``: 200)."""
    response = api.claim()
    assert response.status_code == 200, response.content
    return response.json()["job"]


def bad_request_detail(response) -> str:
    """The ``detail`` of a worker API 400 (``{"error": "bad_request", ...}``)."""
    assert response.status_code == 400, response.content
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert set(body) == {"error", "detail"} and body["error"] == "bad_request"
    return body["detail"]


def _json(body) -> bytes:
    return json.dumps(body).encode()


def assert_consistent(now: datetime = T0) -> None:
    """Every invariant holds (the same checks as ``manage.py recall_check``)."""
    from engine.checks import find_violations

    assert [str(v) for v in find_violations(now=now)] == []


def claim(worker: Worker, now: datetime = T0) -> Job:
    job = transitions.claim_next(worker, now=now)
    assert job is not None, "expected a claimable job"
    return job


def make_user(username: str, *groups: str, **extra):
    """A user in the given groups (Viewers, Operators), or a superuser."""
    from django.contrib.auth.models import Group, User

    from batches.roles import ensure_groups

    if extra.pop("superuser", False):
        return User.objects.create_superuser(username, f"{username}@example.com", "pw")
    user = User.objects.create_user(username, password="pw", **extra)
    if groups and not Group.objects.filter(name__in=groups).exists():
        ensure_groups()  # a transactional test's flush removed the migrated groups
    for name in groups:
        user.groups.add(Group.objects.get(name=name))
    return user


def make_endpoint(
    url: str = "https://receiver.example/hooks",
    events: tuple[str, ...] = ("batch.finished",),
):
    """A webhook endpoint (no destination check: nothing is sent to it unless a
    test delivers), and its secret."""
    endpoint, secret = transitions.create_webhook_endpoint(
        url, events=list(events), now=T0
    )
    endpoint.secret = secret
    return endpoint


def finished_batch(
    n: int = 3,
    *,
    durations: list[float | None] | None = None,
    text: str = "hello",
) -> Batch:
    """A finished batch of ``n`` items (one per duration with ``durations``),
    each done with the transcript ``text`` by a worker of its own ("hello",
    one word, is short for a minute of audio): a re-run's starting point."""
    batch = make_batch(n) if durations is None else make_batch(durations=durations)
    worker = make_worker(f"w-{batch.pk}")
    for _ in range(len(jobs_of(batch))):
        job = transitions.claim_next(worker)
        transitions.complete(job, job.lease_token, worker=worker, result={"text": text})
    return batch


def item_ids(batch: Batch) -> list[int]:
    """The batch's item ids, in order."""
    return list(
        BatchItem.objects.filter(batch=batch)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def make_changer(name: str = "changer", *groups: str):
    """A user in ``groups`` (Operators by default) who may also change
    batches (``batches.change_batch``: re-run, requirements)."""
    from django.contrib.auth.models import Permission

    user = make_user(name, *(groups or ("Operators",)))
    user.user_permissions.add(
        Permission.objects.get(
            content_type__app_label="batches", codename="change_batch"
        )
    )
    return user


def finished_events(batch: Batch) -> list:
    from jobs.models import WebhookEvent

    return list(
        WebhookEvent.objects.filter(batch=batch, type="batch.finished").order_by(
            "generation"
        )
    )
