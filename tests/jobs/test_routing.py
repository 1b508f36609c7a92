"""Routing: the labels a worker declares with its claim, and the batches whose
requirements they satisfy (the only ones it may take jobs from).

The transition-level cases run on both backends on PostgreSQL (the statement
backend matches requirements in SQL, the ORM backend in Python) and on the
ORM backend on SQLite; the API cases check the pinned request shapes.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from api.waiter import KEEP_WAITING, ClaimRequest
from api.worker_views import claims_for_waiting
from batches.labels import satisfies
from batches.models import Batch
from engine.longpoll import claimable_work
from jobs import transitions
from jobs.models import Job, JobStatus, Worker
from jobs.transitions.rules import CLAIM_BATCH_CANDIDATES
from tests.support.factories import T0, assert_consistent, make_batch, make_worker

pytestmark = pytest.mark.django_db

BACKENDS = ["auto", "orm"]  # on SQLite both are the ORM backend

GPU = {"gpu": "a100"}
GPU_LARGE = {"gpu": "a100", "model": "large-v3"}


def require(batch: Batch, requires: dict[str, str]) -> Batch:
    """Give a batch requirements (as an operator's edit would)."""
    Batch.objects.filter(pk=batch.pk).update(requires=requires)
    batch.requires = requires
    return batch


def _batches_of(worker: Worker) -> list[int]:
    return list(
        Job.objects.filter(leased_by=worker)
        .order_by("pk")
        .values_list("batch_id", flat=True)
    )


# --- Transitions ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_takes_only_jobs_of_batches_it_can_serve(settings, backend):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    gpu = require(make_batch(2, name="gpu", priority=5), GPU)
    large = require(make_batch(3, name="large", priority=5), GPU_LARGE)
    anyone = make_batch(2, name="anyone")
    plain, a100, full = (make_worker(n) for n in ("plain", "a100", "full"))

    # The batches of priority 5 come first, but only for those who serve them.
    assert transitions.claim_next(plain, now=T0).batch_id == anyone.pk
    assert transitions.claim_next(a100, labels=GPU, now=T0).batch_id == gpu.pk
    labels = {**GPU_LARGE, "extra": "never-hurts"}
    taken = [transitions.claim_next(full, labels=labels, now=T0) for _ in range(3)]
    assert {job.batch_id for job in taken} == {gpu.pk, large.pk}
    assert transitions.claim_next(a100, labels=GPU, now=T0).batch_id == anyone.pk
    # Nothing left that the plain worker can serve: None, though jobs are queued.
    assert transitions.claim_next(plain, now=T0) is None
    assert transitions.claim_next(a100, labels=GPU, now=T0) is None
    assert Job.objects.filter(status=JobStatus.QUEUED).count() == 1
    assert transitions.claim_next(full, labels=labels, now=T0).batch_id == large.pk
    for worker in (plain, a100, full):
        for job in Job.objects.filter(leased_by=worker).select_related("batch"):
            worker.refresh_from_db()
            assert satisfies(worker.labels, job.batch.requires)
    assert_consistent()


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_batches_it_cannot_serve_never_hide_one_it_can(settings, backend):
    """More unservable batches ahead of it in claim order than one claim looks
    at (CLAIM_BATCH_CANDIDATES): the servable one behind them is still found."""
    settings.RECALL_TRANSITIONS_BACKEND = backend
    for n in range(CLAIM_BATCH_CANDIDATES + 5):
        require(make_batch(1, name=f"h100-{n}", priority=5), {"gpu": "h100"})
    servable = make_batch(1, name="cpu")
    worker = make_worker()

    job = transitions.claim_next(worker, labels={"cpu": "x86"}, now=T0)

    assert job is not None and job.batch_id == servable.pk
    assert transitions.claim_next(worker, labels={"cpu": "x86"}, now=T0) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_fair_share_holds_among_the_batches_a_worker_can_serve(settings, backend):
    """Weights 1 and 2 between two batches a worker serves share its claims
    1:2, whatever a batch it cannot serve (ahead of them) holds."""
    settings.RECALL_TRANSITIONS_BACKEND = backend
    require(make_batch(10, name="other", priority=5), {"gpu": "h100"})
    light, heavy = make_batch(10, name="light"), make_batch(10, name="heavy")
    Batch.objects.filter(pk=heavy.pk).update(weight=2)
    worker = make_worker()

    taken = [transitions.claim_next(worker, labels=GPU, now=T0) for _ in range(9)]

    shares = [job.batch_id for job in taken]
    assert (shares.count(light.pk), shares.count(heavy.pk)) == (3, 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_requirement_changed_after_the_plan_is_checked_again(settings, backend):
    """The batch chosen is checked again when its job is taken: a worker never
    gets a job of a batch whose requirements it does not satisfy then."""
    settings.RECALL_TRANSITIONS_BACKEND = backend
    batch = make_batch(1)
    worker = make_worker()
    chosen = transitions.backend()
    (candidate,) = chosen._claim_plan(T0, {})[2]
    require(batch, GPU)  # between the plan and the claim

    job = chosen._claim_in_batch(
        candidate, worker, T0, labels={}, charge=False, max_leases=10
    )

    assert job is None
    assert Job.objects.get().status == JobStatus.QUEUED


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_labels_of_the_latest_claim_are_kept_and_written_only_when_changed(
    settings, backend
):
    settings.RECALL_TRANSITIONS_BACKEND = backend
    make_batch(5)
    worker = make_worker()
    table = Worker._meta.db_table

    def label_writes(labels):
        with CaptureQueriesContext(connection) as queries:
            transitions.claim_next(worker, labels=labels, now=T0)
        return [
            q["sql"]
            for q in queries.captured_queries
            if q["sql"].startswith(f'UPDATE "{table}"') and "labels" in q["sql"]
        ]

    assert len(label_writes(GPU)) == 1
    assert Worker.objects.get(pk=worker.pk).labels == GPU
    # The same labels again (as the worker loaded at authentication has them).
    worker = Worker.objects.get(pk=worker.pk)
    assert label_writes(dict(GPU)) == []
    assert len(label_writes(None)) == 1  # a claim without labels declares none
    assert Worker.objects.get(pk=worker.pk).labels == {}
    assert label_writes({}) == []


# --- The worker API ----------------------------------------------------------------


def _error(response, detail: str) -> None:
    assert response.status_code == 400, response.content
    assert response.json() == {"error": "bad_request", "detail": detail}


KEY_RULE = (
    "must be 1 to 63 characters of a-z, 0-9, '_', '.' and '-', starting with a "
    "letter or digit"
)
VALUE_RULE = "must be 1 to 63 characters of A-Z, a-z, 0-9 and '_.:/-'"


@pytest.mark.parametrize(
    ("labels", "detail"),
    [
        ("gpu=a100", "Field 'labels' must be an object of KEY: VALUE strings."),
        (["gpu"], "Field 'labels' must be an object of KEY: VALUE strings."),
        (5, "Field 'labels' must be an object of KEY: VALUE strings."),
        (True, "Field 'labels' must be an object of KEY: VALUE strings."),
        (None, "Field 'labels' must be an object of KEY: VALUE strings."),
        ({"GPU": "a100"}, f"Field 'labels': key 'GPU' {KEY_RULE}."),
        ({"": "a100"}, f"Field 'labels': key '' {KEY_RULE}."),
        ({"-gpu": "a100"}, f"Field 'labels': key '-gpu' {KEY_RULE}."),
        ({"g" * 64: "a100"}, f"Field 'labels': key '{'g' * 64}' {KEY_RULE}."),
        ({"gpu": ""}, f"Field 'labels': value of 'gpu' {VALUE_RULE}."),
        ({"gpu": "a 100"}, f"Field 'labels': value of 'gpu' {VALUE_RULE}."),
        ({"gpu": "v" * 64}, f"Field 'labels': value of 'gpu' {VALUE_RULE}."),
        ({"gpu": 100}, f"Field 'labels': value of 'gpu' {VALUE_RULE}."),
        ({"gpu": None}, f"Field 'labels': value of 'gpu' {VALUE_RULE}."),
        ({"gpu": ["a100"]}, f"Field 'labels': value of 'gpu' {VALUE_RULE}."),
        ({"gpu": {"a": "b"}}, f"Field 'labels': value of 'gpu' {VALUE_RULE}."),
        (
            {f"k{i}": "v" for i in range(17)},
            "Field 'labels': at most 16 labels, got 17.",
        ),
    ],
)
def test_bad_labels_are_400_and_claim_nothing(api, labels, detail):
    make_batch(1)

    response = api.post("/api/v1/claim", {"labels": labels})

    _error(response, detail)
    assert Job.objects.get().status == JobStatus.QUEUED
    assert Worker.objects.get(pk=api.worker.pk).labels == {}


def test_a_claim_declares_its_labels_and_gets_only_work_they_serve(api):
    gpu = require(make_batch(1, name="gpu", priority=5), GPU)
    make_batch(1, name="anyone")
    labels = {f"k{i}": "v" for i in range(14)} | GPU_LARGE  # 16: the most allowed

    plain = api.post("/api/v1/claim", {})
    routed = api.post("/api/v1/claim", {"labels": labels})

    assert plain.json()["job"]["batch"]["name"] == "anyone"
    assert routed.json()["job"]["batch"] == {"id": gpu.pk, "name": "gpu"}
    assert Worker.objects.get(pk=api.worker.pk).labels == labels
    # No field declares none; nothing left for none: 204.
    assert api.post("/api/v1/claim", {"wait_seconds": 0}).status_code == 204
    assert Worker.objects.get(pk=api.worker.pk).labels == {}


# --- Long-poll: only work it can take wakes a waiting claim ------------------------


def test_the_probe_names_the_requirements_of_the_work_it_found():
    require(make_batch(2, name="gpu"), GPU)
    make_batch(1, name="anyone")
    require(make_batch(1, name="large"), GPU_LARGE)

    found, requires = claimable_work(10, now=T0)

    assert found == 4
    assert sorted(requires, key=len) == [{}, GPU, GPU_LARGE]
    assert claimable_work(2, now=T0)[0] == 2
    assert claimable_work(0, now=T0) == (0, [])


def test_a_waiting_claim_serves_only_the_requirements_it_satisfies():
    plain = ClaimRequest(wait_seconds=30)
    a100 = ClaimRequest(wait_seconds=30, labels=GPU)

    assert plain.serves([{}]) and a100.serves([{}])
    assert not plain.serves([GPU]) and a100.serves([GPU])
    assert not a100.serves([GPU_LARGE, {"gpu": "h100"}])
    assert plain.serves(None)  # unknown: anyone may find work
    assert not plain.serves([])
    # What the server runs again through the view: labels kept, none left out.
    assert json.loads(a100.body()) == {"wait_seconds": 30, "labels": GPU}
    assert json.loads(plain.body()) == {"wait_seconds": 30}


def test_a_woken_claim_that_cannot_serve_the_work_waits_on_and_gets_no_job():
    """Woken for work it cannot take, a claim gets no job and waits on
    (KEEP_WAITING, not a 204); the claims behind it are still tried, and one
    whose labels serve the batch gets the job."""
    batch = require(make_batch(1, name="gpu"), GPU)
    plain, other_plain, a100 = (make_worker(n) for n in ("plain", "plain2", "a100"))
    bearer = "Bearer {}".format
    waiting = [
        (bearer(plain.token), ClaimRequest(wait_seconds=30)),
        (bearer(other_plain.token), ClaimRequest(wait_seconds=30)),
        (bearer(a100.token), ClaimRequest(wait_seconds=30, labels=GPU)),
    ]

    answers = list(claims_for_waiting(waiting))

    assert answers[:2] == [KEEP_WAITING, KEEP_WAITING]
    job = Job.objects.get(pk=json.loads(answers[2])["job"]["id"])
    assert (job.batch_id, job.leased_by_id) == (batch.pk, a100.pk)
    assert Worker.objects.get(pk=a100.pk).labels == GPU
