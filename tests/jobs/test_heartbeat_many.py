"""The batched heartbeat: many leases of one worker renewed in one transaction,
each judged exactly as the single heartbeat judges it."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction

from jobs import transitions
from jobs.exceptions import LeaseLost
from jobs.models import Job, Lease
from jobs.transitions.rules import LEASE_LOST, NOT_FOUND
from tests.support.factories import (
    claim,
    failpoint,
    is_postgres,
    later,
    make_batch,
    make_worker,
    snapshot,
)
from tests.support.stack import wait_for

pytestmark = pytest.mark.django_db


def _deadlines(*jobs: Job) -> list:
    return [
        Job.objects.filter(pk=job.pk).values_list("lease_expires_at", "heartbeat_at")[0]
        for job in jobs
    ]


def test_renews_every_lease_asked_for_and_their_ledger_rows(worker):
    make_batch(4)
    jobs = [claim(worker) for _ in range(3)]

    answers = transitions.heartbeat_many(
        [(job.pk, job.lease_token) for job in reversed(jobs)],
        worker=worker,
        now=later(40),
    )

    expires = later(40) + timedelta(seconds=60)
    assert answers == [expires, expires, expires]
    assert _deadlines(*jobs) == [(expires, later(40))] * 3
    ledger = Lease.objects.filter(job__in=jobs).order_by("job_id")
    assert [(row.heartbeat_at, row.expires_at, row.ended_at) for row in ledger] == [
        (later(40), expires, None)
    ] * 3


def test_renewed_lost_and_unknown_in_one_call_answer_in_request_order(
    worker, other_worker
):
    make_batch(5)
    mine, expired, wrong, done = (claim(worker) for _ in range(4))
    theirs = claim(other_worker)
    transitions.complete(
        done, done.lease_token, worker=worker, result={"text": "x"}, now=later(1)
    )
    untouched = snapshot(wrong, theirs, done)

    answers = transitions.heartbeat_many(
        [
            (999_999, "no-such-job"),
            (mine.pk, mine.lease_token),
            (theirs.pk, theirs.lease_token),  # another worker's lease
            (wrong.pk, "not-the-token"),
            (done.pk, done.lease_token),  # completed: the lease ended
            (expired.pk, expired.lease_token),  # expired, not yet reclaimed: live
            (0, "t"),
            (2**63, "t"),  # larger than any id a column holds
        ],
        worker=worker,
        now=later(500),
    )

    expires = later(560)
    assert answers == [
        NOT_FOUND,
        expires,
        LEASE_LOST,
        LEASE_LOST,
        LEASE_LOST,
        expires,
        NOT_FOUND,
        NOT_FOUND,
    ]
    assert _deadlines(mine, expired) == [(expires, later(500))] * 2
    assert snapshot(wrong, theirs, done) == untouched


def test_each_lease_is_judged_as_the_single_heartbeat_judges_it(worker, other_worker):
    """Every kind of lease, asked for alone and in a batch: the same answers."""
    make_batch(5)
    jobs = [claim(worker) for _ in range(3)] + [claim(other_worker)]
    transitions.release(jobs[2], jobs[2].lease_token, worker=worker, now=later(1))
    asked = [(job.pk, job.lease_token) for job in jobs] + [(jobs[0].pk + 100, "x")]

    alone = []
    for job_id, token in asked:
        try:
            alone.append(
                transitions.heartbeat(job_id, token, worker=worker, now=later(9))
            )
        except LeaseLost:
            exists = Job.objects.filter(pk=job_id).exists()
            alone.append(LEASE_LOST if exists else NOT_FOUND)
    together = transitions.heartbeat_many(asked, worker=worker, now=later(9))

    assert (
        together == alone == [later(69), later(69), LEASE_LOST, LEASE_LOST, NOT_FOUND]
    )


def test_a_lease_lost_to_a_reclaim_is_lost_and_the_new_lease_untouched(worker):
    make_batch(2)
    old = claim(worker)
    keep = claim(worker)
    transitions.heartbeat(keep, keep.lease_token, worker=worker, now=later(50))
    assert transitions.reclaim_expired(now=later(61))["requeued"] == 1
    new = claim(worker, now=later(62))
    assert new.pk == old.pk and new.lease_token != old.lease_token

    answers = transitions.heartbeat_many(
        [(old.pk, old.lease_token), (keep.pk, keep.lease_token)],
        worker=worker,
        now=later(70),
    )

    assert answers == [LEASE_LOST, later(130)]
    assert _deadlines(new) == [
        (later(122), later(62))
    ]  # the fenced token moved nothing


def test_an_empty_batch_asks_nothing(worker):
    assert transitions.heartbeat_many([], worker=worker, now=later(1)) == []


def test_job_ids_must_be_distinct(worker, batch):
    job = claim(worker)
    with pytest.raises(ValueError, match="at most once"):
        transitions.heartbeat_many(
            [(job.pk, job.lease_token), (job.pk, job.lease_token)],
            worker=worker,
            now=later(1),
        )


def test_renews_all_or_nothing(worker):
    """One transaction: when writing one ledger row fails, no deadline moved."""
    make_batch(3)
    jobs = [claim(worker) for _ in range(3)]
    before = snapshot(*jobs)

    with (
        failpoint(Lease._meta.db_table),
        pytest.raises(DatabaseError, match="failpoint"),
        transaction.atomic(),
    ):
        transitions.heartbeat_many(
            [(job.pk, job.lease_token) for job in jobs], worker=worker, now=later(9)
        )

    assert snapshot(*jobs) == before


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_waits_for_a_locked_lease_then_judges_it_as_it_is_then():
    """A heartbeat that meets a job locked by a completion in progress waits for
    it, then judges that lease as the completion left it (lost) and renews the
    others; until it commits, none of its renewals is visible."""
    worker = make_worker("gpu-1")
    make_batch(3)
    jobs = [claim(worker) for _ in range(3)]
    middle = jobs[1]
    locked, finish = threading.Event(), threading.Event()
    answers: list = []

    def complete_slowly() -> None:
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=middle.pk)
                locked.set()
                finish.wait(30)
                transitions.complete(
                    middle,
                    middle.lease_token,
                    worker=worker,
                    result={"text": "done"},
                    now=later(5),
                )
        finally:
            connection.close()

    def beat() -> None:
        try:
            answers.extend(
                transitions.heartbeat_many(
                    [(job.pk, job.lease_token) for job in jobs],
                    worker=worker,
                    now=later(10),
                )
            )
        finally:
            connection.close()

    completer = threading.Thread(target=complete_slowly)
    completer.start()
    assert locked.wait(30)
    beating = threading.Thread(target=beat)
    beating.start()
    _wait_until_blocked_on_a_lock()
    assert _deadlines(*jobs) == [(later(60), jobs[0].heartbeat_at)] * 3
    finish.set()
    completer.join(30)
    beating.join(30)

    assert answers == [later(70), LEASE_LOST, later(70)]
    assert _deadlines(jobs[0], jobs[2]) == [(later(70), later(10))] * 2


def _wait_until_blocked_on_a_lock() -> None:
    """Until another connection of this database waits for a row lock."""
    assert is_postgres()

    def blocked() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                "current_database() AND wait_event_type = 'Lock'"
            )
            return cursor.fetchone()[0]

    wait_for(blocked, 30, "the heartbeat to wait for the locked job")
