"""Fair share: strict priority, weights, in-flight caps, no starvation."""

from __future__ import annotations

from collections import Counter

import pytest
from django.db import connections

from jobs import transitions
from jobs.models import Event, Job, JobStatus
from tests.support.factories import (
    T0,
    assert_consistent,
    later,
    make_batch,
    make_worker,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _one_worker_stands_for_a_fleet(settings):
    """These tests claim many jobs with one worker, without completing them:
    no lease cap (it is tested in test_claim.py and test_concurrency.py)."""
    settings.RECALL_MAX_LEASES_PER_WORKER = 10_000


def _claim_batches(worker, n: int, now=T0) -> list[int]:
    """Claim ``n`` times (without completing); the batch of each claim."""
    batches = []
    for _ in range(n):
        job = transitions.claim_next(worker, now=now)
        assert job is not None
        batches.append(job.batch_id)
    return batches


def test_a_small_batch_is_not_stuck_behind_a_big_one(worker):
    big = make_batch(200, name="big")
    small = make_batch(10, name="small")
    done: Counter[int] = Counter()
    small_finished_when_big_had = None
    while small_finished_when_big_had is None:
        job = transitions.claim_next(worker, now=T0)
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": "t"}, now=T0
        )
        done[job.batch_id] += 1
        if done[small.pk] == 10:
            small_finished_when_big_had = done[big.pk]

    assert small_finished_when_big_had < 15
    assert small_finished_when_big_had == 10  # strictly alternating
    assert_consistent()


def test_claims_are_shared_by_weight(worker):
    heavy = make_batch(20, name="heavy")
    light = make_batch(20, name="light")
    transitions.set_share(heavy, priority=0, weight=3, max_in_flight=None, now=T0)

    shares = Counter(_claim_batches(worker, 8))

    assert shares == {heavy.pk: 6, light.pk: 2}


def test_shares_follow_weights_over_many_claims(worker):
    batches = [make_batch(60, name=f"w{w}") for w in (1, 2, 5)]
    for batch, weight in zip(batches, (1, 2, 5), strict=True):
        transitions.set_share(
            batch, priority=0, weight=weight, max_in_flight=None, now=T0
        )

    shares = Counter(_claim_batches(worker, 80))

    assert [shares[b.pk] for b in batches] == [10, 20, 50]


def test_priority_stays_strict(worker):
    normal = make_batch(5, name="normal")
    urgent = make_batch(3, name="urgent", priority=5)
    transitions.set_share(normal, priority=0, weight=1000, max_in_flight=None, now=T0)

    assert _claim_batches(worker, 5) == [urgent.pk] * 3 + [normal.pk] * 2


def test_a_new_batch_joins_the_rotation_with_its_first_claim(worker):
    old = make_batch(100, name="old")
    other = make_batch(100, name="other")
    _claim_batches(worker, 40)  # both far into their share
    new = make_batch(5, name="new")

    # Within one round of the rotation, not after the older batches' 160 items.
    assert sorted(_claim_batches(worker, 3)) == [old.pk, other.pk, new.pk]
    assert Counter(_claim_batches(worker, 6)) == {old.pk: 2, other.pk: 2, new.pk: 2}


def test_a_resumed_batch_does_not_catch_up_on_its_paused_time(worker):
    paused = make_batch(50, name="paused")
    running = [make_batch(50, name=f"running-{i}") for i in range(2)]
    transitions.pause_batch(paused, now=T0)
    assert Counter(_claim_batches(worker, 20)) == {b.pk: 10 for b in running}

    transitions.resume_batch(paused, now=T0)
    after = _claim_batches(worker, 9)

    # From the resume on the three share alike: no run of ten claims for the
    # batch that was paused while the others worked.
    assert Counter(after) == {paused.pk: 3, running[0].pk: 3, running[1].pk: 3}


def test_a_batch_alone_at_its_priority_owes_nobody(worker):
    alone = make_batch(10, name="alone")
    _claim_batches(worker, 5)
    alone.refresh_from_db()
    assert alone.virtual_time == 0

    joined = make_batch(10, name="joined")
    assert Counter(_claim_batches(worker, 4)) == {alone.pk: 2, joined.pk: 2}


def test_the_cap_sends_claims_to_the_next_batch(worker):
    capped = make_batch(10, name="capped")
    other = make_batch(10, name="other")
    transitions.set_share(capped, priority=5, weight=1, max_in_flight=2, now=T0)

    claimed = _claim_batches(worker, 6)

    assert claimed[:2] == [capped.pk, capped.pk]
    assert claimed[2:] == [other.pk] * 4  # work-conserving, never 204
    assert Job.objects.filter(batch=capped, status=JobStatus.LEASED).count() == 2

    # A completion makes room again: the capped batch (higher priority) is next.
    job = Job.objects.filter(batch=capped, status=JobStatus.LEASED).first()
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "t"}, now=T0
    )
    assert _claim_batches(worker, 1) == [capped.pk]


def test_a_batch_at_its_cap_with_nothing_else_to_do_gets_no_claim(worker):
    capped = make_batch(5, name="capped")
    transitions.set_share(capped, priority=0, weight=1, max_in_flight=1, now=T0)

    assert _claim_batches(worker, 1) == [capped.pk]
    assert transitions.claim_next(worker, now=T0) is None


def test_share_changes_are_events_with_who_and_what(worker, django_user_model):
    operator = django_user_model.objects.create_user("op", password="pw")
    batch = make_batch(3)

    changes = transitions.set_share(
        batch, priority=2, weight=4, max_in_flight=8, actor=operator, now=later(5)
    )
    unchanged = transitions.set_share(
        batch, priority=2, weight=4, max_in_flight=8, actor=operator, now=later(6)
    )

    assert changes == [
        "priority 0 -> 2",
        "weight 1 -> 4",
        "max in flight unlimited -> 8",
    ]
    assert unchanged == []
    event = Event.objects.get(batch=batch, kind=Event.Kind.BATCH_CHANGED)
    assert (event.actor, event.created_at) == (operator, later(5))
    assert event.message == (
        "Changed priority 0 -> 2, weight 1 -> 4, max in flight unlimited -> 8."
    )
    batch.refresh_from_db()
    assert (batch.priority, batch.weight, batch.max_in_flight) == (2, 4, 8)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_cap_holds_under_sixteen_concurrent_claimers():
    from tests.support.threads import run_threads

    capped = make_batch(40, name="capped", priority=1)
    other = make_batch(40, name="other")
    transitions.set_share(capped, priority=1, weight=1, max_in_flight=3, now=T0)
    workers = [make_worker(f"w{i}") for i in range(16)]
    claimed: list[int] = []

    def claim_twice(i, barrier):
        try:
            barrier.wait()
            for _ in range(2):
                job = transitions.claim_next(workers[i], now=T0)
                if job is not None:
                    claimed.append(job.batch_id)
        finally:
            connections.close_all()

    run_threads(claim_twice, n=16)

    shares = Counter(claimed)
    assert shares == {capped.pk: 3, other.pk: 29}
    assert Job.objects.filter(batch=capped, status=JobStatus.LEASED).count() == 3
    assert_consistent()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_claim_takes_the_next_share_rather_than_wait_for_a_charge_to_commit():
    """Claims that start together find the same least virtual time; one that
    finds that batch's row held by another claim's charge takes the next
    batch in share order at once, and the shares come out as claims in a row
    would share them."""
    import threading

    from django.db import transaction

    if transitions.backend().name != "postgres":
        pytest.skip("row locks with SKIP LOCKED belong to the PostgreSQL backend")
    first, second, third = (make_batch(4, name=n) for n in ("a", "b", "c"))
    slow, quick = make_worker("slow"), make_worker("quick")
    charging, release = threading.Event(), threading.Event()
    held: list[int] = []

    def claim_and_hold_the_commit():
        try:
            with transaction.atomic():
                held.append(transitions.claim_next(slow, now=T0).batch_id)
                charging.set()
                release.wait(timeout=30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=claim_and_hold_the_commit)
    holder.start()
    try:
        assert charging.wait(timeout=30)
        assert held == [first.pk]
        with transaction.atomic(), connections["default"].cursor() as cursor:
            # Waiting for the held row fails this test instead of hanging it.
            cursor.execute("SET LOCAL lock_timeout = '5s'")
            taken = transitions.claim_next(quick, now=T0)
        assert taken.batch_id == second.pk
    finally:
        release.set()
        holder.join(timeout=30)

    # Both charges stand: the third batch is next, then the rotation goes on.
    assert _claim_batches(quick, 3) == [third.pk, first.pk, second.pk]
    assert_consistent()
