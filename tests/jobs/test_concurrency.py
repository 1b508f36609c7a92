"""Real concurrency: threads with their own database connections, real commits.

Run on PostgreSQL (row locks, SKIP LOCKED) and on SQLite (BEGIN IMMEDIATE
serialises writers): the guarantees are the same.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connections

from engine.sweep import sweep
from jobs import transitions
from jobs.exceptions import LeaseLost, TooManyLeases
from jobs.models import Job, JobStatus, Lease, LeaseEnd
from jobs.transitions.backends.statements import RECLAIM_GATE_KEY
from tests.support.factories import (
    WorkerClient,
    assert_consistent,
    later,
    make_batch,
    make_worker,
)
from tests.support.threads import THREADS, run_threads

pytestmark = pytest.mark.django_db(transaction=True)


def test_concurrent_claims_never_hand_out_the_same_job(settings):
    settings.RECALL_MAX_LEASES_PER_WORKER = 120  # a thread may win most of them
    make_batch(120)
    workers = [make_worker(f"w{i}") for i in range(THREADS)]

    def claim_until_empty(i, barrier):
        barrier.wait()
        mine = []
        while (job := transitions.claim_next(workers[i], now=later(1))) is not None:
            mine.append((job.pk, job.lease_token))
        return mine

    claims = [c for per_thread in run_threads(claim_until_empty) for c in per_thread]

    ids = [job_id for job_id, _ in claims]
    assert len(ids) == 120
    assert len(set(ids)) == 120
    assert Lease.objects.count() == 120
    assert Job.objects.filter(status=JobStatus.LEASED).count() == 120
    assert_consistent(later(1))


def test_concurrent_workers_drain_a_batch_exactly_once():
    batch = make_batch(80)
    workers = [make_worker(f"w{i}") for i in range(THREADS)]

    def work(i, barrier):
        barrier.wait()
        done = 0
        while (job := transitions.claim_next(workers[i], now=later(1))) is not None:
            transitions.complete(
                job,
                job.lease_token,
                worker=workers[i],
                result={"text": str(job.pk)},
                now=later(2),
            )
            done += 1
        return done

    assert sum(run_threads(work)) == 80
    assert batch.counts()["done"] == 80
    completions = Counter(
        Lease.objects.filter(end_reason=LeaseEnd.COMPLETED).values_list(
            "job_id", flat=True
        )
    )
    assert set(completions.values()) == {1}
    assert_consistent(later(2))


def test_two_sweeps_at_once_reclaim_each_lease_exactly_once(settings):
    settings.RECALL_CHUNK_SIZE = 10  # many small transactions to interleave
    settings.RECALL_MAX_LEASES_PER_WORKER = 150  # one worker holds them all
    make_batch(150)
    worker = make_worker("dead")
    while transitions.claim_next(worker, now=later(0)):
        pass

    def sweep_once(i, barrier):
        barrier.wait()
        return sweep(now=later(61))["reclaimed"]

    reports = run_threads(sweep_once, n=2)

    assert sum(r["requeued"] for r in reports) == 150
    assert Job.objects.filter(status=JobStatus.QUEUED, attempts=1).count() == 150
    per_job = Counter(Lease.objects.values_list("job_id", flat=True))
    assert set(per_job.values()) == {1}
    assert set(Lease.objects.values_list("end_reason", flat=True)) == {LeaseEnd.EXPIRED}
    assert_consistent(later(61))


def test_completion_racing_reclaim_has_exactly_one_winner_per_job(settings):
    settings.RECALL_MAX_LEASES_PER_WORKER = 60  # one worker holds them all
    batch = make_batch(60)
    worker = make_worker("slow")
    leased = []
    while (job := transitions.claim_next(worker, now=later(0))) is not None:
        leased.append((job.pk, job.lease_token))

    def complete_all(barrier):
        barrier.wait()
        won = set()
        for job_id, token in leased:
            try:
                transitions.complete(
                    job_id, token, worker=worker, result={"text": "x"}, now=later(70)
                )
                won.add(job_id)
            except LeaseLost:
                pass
        return won

    def reclaim_all(barrier):
        barrier.wait()
        total = 0
        for _ in range(60):
            total += transitions.reclaim_expired(now=later(70), limit=1)["requeued"]
        return total

    completed, reclaimed = run_threads(
        lambda i, barrier: (complete_all, reclaim_all)[i](barrier), n=2
    )

    assert len(completed) + reclaimed == 60
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert {pk for pk, s in statuses.items() if s == JobStatus.COMPLETED} == completed
    assert sum(s == JobStatus.QUEUED for s in statuses.values()) == reclaimed
    assert batch.counts()["done"] == len(completed)
    assert_consistent(later(70))


@pytest.mark.postgres
def test_a_claim_does_not_queue_behind_another_reclaimer_but_a_sweep_does():
    if transitions.backend().name != "postgres":
        pytest.skip("the reclaim gate belongs to the PostgreSQL statement backend")
    make_batch(2)
    worker = make_worker("w")
    stale = transitions.claim_next(worker, now=later(0))
    holding, release = threading.Event(), threading.Event()

    def another_reclaimer(i, barrier):
        # Holds the reclaim gate, as a sweep does while it reclaims a chunk.
        with connections["default"].cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [RECLAIM_GATE_KEY])
            holding.set()
            release.wait(timeout=30)
            cursor.execute("COMMIT")

    gate = threading.Thread(target=run_threads, args=(another_reclaimer, 1))
    gate.start()
    assert holding.wait(timeout=30)
    try:
        # The claim does not wait: it takes the other job, the expired lease is
        # left to whoever holds the gate.
        job = transitions.claim_next(worker, now=later(61))
        assert job is not None and job.pk != stale.pk
        assert Job.objects.get(pk=stale.pk).status == JobStatus.LEASED

        # A sweep waits for the gate, then reclaims.
        swept = []

        def sweep_when_free():
            try:
                swept.append(transitions.reclaim_expired(now=later(62)))
            finally:
                connections.close_all()

        sweeper = threading.Thread(target=sweep_when_free)
        sweeper.start()
        sweeper.join(timeout=1)
        assert sweeper.is_alive() and swept == []
    finally:
        release.set()
        gate.join(timeout=30)
    sweeper.join(timeout=30)
    assert swept == [{"requeued": 1, "failed": 0}]
    assert Job.objects.get(pk=stale.pk).status == JobStatus.QUEUED
    assert_consistent(later(62))


# --- The lease cap under simultaneous claims ----------------------------------------

CAP_CLAIMS = 16


@pytest.mark.parametrize("backend", ["auto", "orm"])
def test_simultaneous_claims_of_one_worker_never_exceed_its_lease_cap(
    settings, backend
):
    """16 claims of one worker at once, with a cap of 2 and 40 jobs free: the
    claim counts the worker's leases after its turn came, so exactly 2 are
    leased and the other 14 are refused; no count read before the turn
    (the view's, or one statement's snapshot) lets more through."""
    settings.RECALL_MAX_LEASES_PER_WORKER = 2
    settings.RECALL_TRANSITIONS_BACKEND = backend
    make_batch(40)
    worker = make_worker()

    def claim_once(i, barrier):
        barrier.wait()
        try:
            job = transitions.claim_next(worker, now=later(1))
        except TooManyLeases as refused:
            return ("refused", refused.held, refused.limit)
        return None if job is None else ("leased", job.pk)

    outcomes = run_threads(claim_once, CAP_CLAIMS)

    leased = [o for o in outcomes if o[0] == "leased"]
    assert len(leased) == 2
    assert sorted(o for o in outcomes if o[0] == "refused") == [("refused", 2, 2)] * (
        CAP_CLAIMS - 2
    )
    assert Job.objects.filter(leased_by=worker, status=JobStatus.LEASED).count() == 2
    assert Lease.objects.count() == 2
    assert_consistent(later(1))


def test_simultaneous_claims_through_the_api_answer_429_beyond_the_cap(settings):
    """The same through the worker API (authentication, the view's early
    refusal, the claim): two 200s, fourteen 429 ``too_many_leases``."""
    settings.RECALL_MAX_LEASES_PER_WORKER = 2
    make_batch(40)
    worker = make_worker()

    def claim_once(i, barrier):
        client = WorkerClient(worker)
        barrier.wait()
        response = client.claim()
        return (
            response.status_code,
            response.json()["error"] if (response.status_code == 429) else None,
            response.get("Retry-After"),
        )

    outcomes = sorted(run_threads(claim_once, CAP_CLAIMS), key=str)

    assert outcomes == sorted(
        [(200, None, None)] * 2 + [(429, "too_many_leases", "20")] * 14, key=str
    )
    assert Job.objects.filter(leased_by=worker, status=JobStatus.LEASED).count() == 2
