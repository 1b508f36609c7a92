"""The outbox: exactly one batch.finished event per time a batch finishes,
written by the transition that finishes it, in its transaction.

Every path that can finish a batch (complete, fail, reclaim to failed, cancel,
reconciliation) writes the event; nothing writes a second one (replays, sweeps,
reconciliation); a batch reopened by "retry failed" that finishes again gets a
new event of the next generation; and if the event (or its delivery) cannot be
written, the finishing transition changes nothing. Runs on PostgreSQL (both
transition backends) and on SQLite.
"""

from __future__ import annotations

import json
import logging

import pytest
from django.db import DatabaseError, OperationalError, connection
from django.test.utils import override_settings

from batches.models import Batch, BatchCounter, BatchItem, ItemStatus
from engine.progress import progress_for
from engine.reconcile import reconcile
from engine.sweep import sweep
from jobs import transitions
from jobs.models import (
    Job,
    JobStatus,
    WebhookDelivery,
    WebhookEvent,
    WebhookEventType,
)
from jobs.transitions import outbox
from tests.support.factories import (
    T0,
    assert_consistent,
    claim,
    failpoint,
    finished_events,
    jobs_of,
    later,
    make_batch,
    make_endpoint,
    make_worker,
    snapshot,
)

pytestmark = pytest.mark.django_db

COUNTS_ZERO = {"queued": 0, "transcribing": 0, "done": 0, "failed": 0, "cancelled": 0}


def _complete(worker, job, at=T0):
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=at
    )


def _body(event: WebhookEvent) -> dict:
    return json.loads(event.body)


def test_the_last_completion_writes_one_event_with_the_pinned_payload(worker):
    endpoint = make_endpoint()
    batch = make_batch(2, name="Interviews")
    first, second = claim(worker), claim(worker)
    _complete(worker, first, later(1))
    assert finished_events(batch) == []
    assert Batch.objects.get(pk=batch.pk).finished_at is None

    _complete(worker, second, later(2))

    batch.refresh_from_db()
    assert batch.finished_at == later(2)
    assert batch.finishes == 1
    [event] = finished_events(batch)
    assert event.generation == 1
    assert event.created_at == later(2)
    assert event.webhook_id.startswith("msg_") and len(event.webhook_id) == 36
    assert _body(event) == {
        "type": "batch.finished",
        "timestamp": "2026-01-01T12:00:02+00:00",
        "data": {
            "batch": {
                "id": batch.pk,
                "name": "Interviews",
                "state": "finished",
                "total": 2,
                "counts": {**COUNTS_ZERO, "done": 2},
                "finished_at": "2026-01-01T12:00:02+00:00",
                "url": f"/batches/{batch.pk}/",
            }
        },
    }
    assert " " not in event.body  # compact: the exact bytes signed and sent
    # The same word the operator UI shows.
    assert progress_for(batch, now=later(3)).state == "finished"
    [delivery] = WebhookDelivery.objects.filter(event=event)
    assert (delivery.endpoint_id, delivery.status, delivery.attempts) == (
        endpoint.pk,
        "pending",
        0,
    )
    assert delivery.next_attempt_at == later(2)
    assert_consistent(later(3))


@override_settings(RECALL_PUBLIC_URL="https://recall.example.com")
def test_the_payload_links_to_the_public_url(worker):
    batch = make_batch(1)
    _complete(worker, claim(worker))

    [event] = finished_events(batch)
    url = f"https://recall.example.com/batches/{batch.pk}/"
    assert _body(event)["data"]["batch"]["url"] == url


def test_a_batch_without_endpoints_still_records_its_finish(worker):
    batch = make_batch(1)
    _complete(worker, claim(worker))

    assert len(finished_events(batch)) == 1
    assert not WebhookDelivery.objects.exists()


def test_the_last_permanent_failure_finishes_and_reports_the_item(worker):
    make_endpoint(events=("batch.finished", "item.failed"))
    batch = make_batch(2)
    done, broken = claim(worker), claim(worker)
    _complete(worker, done, later(1))

    transitions.fail(
        broken,
        broken.lease_token,
        worker=worker,
        error="not audio",
        retryable=False,
        now=later(2),
    )

    [finished] = finished_events(batch)
    assert _body(finished)["data"]["batch"]["counts"] == {
        **COUNTS_ZERO,
        "done": 1,
        "failed": 1,
    }
    [failed] = WebhookEvent.objects.filter(type=WebhookEventType.ITEM_FAILED)
    assert failed.item_id == broken.item_id
    assert failed.pk < finished.pk  # in the order they happened
    assert _body(failed) == {
        "type": "item.failed",
        "timestamp": "2026-01-01T12:00:02+00:00",
        "data": {
            "batch": {"id": batch.pk},
            "item": {
                "id": broken.item_id,
                "source": broken.item.source,
                "attempts": 1,
                "last_error": "not audio",
            },
        },
    }
    assert WebhookDelivery.objects.count() == 2


def test_item_failed_is_written_only_for_subscribers_and_failures_for_good(worker):
    make_endpoint(events=("batch.finished",))
    make_batch(2)
    job = claim(worker)
    transitions.fail(job, job.lease_token, worker=worker, error="x", retryable=False)
    assert not WebhookEvent.objects.filter(type="item.failed").exists()

    make_endpoint("https://other.example/", events=("item.failed",))
    job = claim(worker)
    transitions.fail(job, job.lease_token, worker=worker, error="flaky", now=T0)
    assert Job.objects.get(pk=job.pk).status == JobStatus.QUEUED  # retried later
    assert not WebhookEvent.objects.filter(type="item.failed").exists()


@override_settings(RECALL_MAX_ATTEMPTS=1)
def test_a_reclaim_on_the_last_attempt_finishes_the_batch(worker):
    make_endpoint(events=("batch.finished", "item.failed"))
    batch = make_batch(1)
    job = claim(worker)

    assert transitions.reclaim_expired(now=later(61)) == {"requeued": 0, "failed": 1}

    [event] = finished_events(batch)
    assert event.created_at == later(61)
    assert _body(event)["data"]["batch"]["counts"] == {**COUNTS_ZERO, "failed": 1}
    [failed] = WebhookEvent.objects.filter(type="item.failed")
    assert _body(failed)["data"]["item"]["id"] == job.item_id
    assert _body(failed)["data"]["item"]["last_error"].startswith("Gave up")


def test_a_requeueing_reclaim_finishes_nothing(worker):
    batch = make_batch(1)
    claim(worker)

    assert transitions.reclaim_expired(now=later(61)) == {"requeued": 1, "failed": 0}

    assert finished_events(batch) == []
    assert Batch.objects.get(pk=batch.pk).finished_at is None


def test_a_cancel_finishes_the_batch_as_cancelled(worker):
    make_endpoint()
    batch = make_batch(3)
    _complete(worker, claim(worker))
    claim(worker)  # in flight: cancelled too

    transitions.cancel_batch(batch, now=later(5))

    [event] = finished_events(batch)
    data = _body(event)["data"]["batch"]
    assert data["state"] == "cancelled"
    assert data["counts"] == {**COUNTS_ZERO, "done": 1, "cancelled": 2}
    assert data["finished_at"] == "2026-01-01T12:00:05+00:00"
    assert progress_for(batch, now=later(5)).state == "cancelled"
    assert transitions.settle(now=later(6)) == 0
    assert len(finished_events(batch)) == 1


def test_cancelling_the_last_queued_job_finishes_the_batch(worker):
    batch = make_batch(2)
    _complete(worker, claim(worker))
    last = jobs_of(batch)[1]

    assert transitions.cancel_job(last, now=later(1))

    [event] = finished_events(batch)
    assert _body(event)["data"]["batch"]["state"] == "finished"
    assert _body(event)["data"]["batch"]["counts"] == {
        **COUNTS_ZERO,
        "done": 1,
        "cancelled": 1,
    }


def test_cancelling_queued_jobs_in_chunks_finishes_once(worker, settings):
    settings.RECALL_CHUNK_SIZE = 2
    batch = make_batch(5)

    assert transitions.cancel_queued(Job.objects.filter(batch=batch), now=T0) == 5

    assert [e.generation for e in finished_events(batch)] == [1]


def test_reconciliation_failing_an_exhausted_job_finishes_the_batch(worker):
    batch = make_batch(2)
    _complete(worker, claim(worker))
    stuck = jobs_of(batch)[1]
    # Behind Recall's back: queued, but with no attempt left (it can never run).
    Job.objects.filter(pk=stuck.pk).update(attempts=stuck.max_attempts)

    report = reconcile(now=later(1))

    assert report.exhausted_failed == 1
    [event] = finished_events(batch)
    assert _body(event)["data"]["batch"]["counts"]["failed"] == 1


def test_the_sweep_heals_a_finish_nobody_noticed(worker):
    """Rows written behind Recall's back (an old release, a manual edit) leave
    a batch with nothing to do but not marked finished: the sweep's settle
    finishes it, with its event, once."""
    batch = make_batch(1)
    [job] = jobs_of(batch)
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.CANCELLED, finished_at=T0, updated_at=T0
    )
    BatchItem.objects.filter(pk=job.item_id).update(status=ItemStatus.CANCELLED)
    shard = BatchCounter.objects.get(batch=batch, queued=1)
    BatchCounter.objects.filter(pk=shard.pk).update(queued=0, cancelled=1)
    assert finished_events(batch) == []

    report = sweep(now=later(1))

    assert report["batches_finished"] == 1
    [event] = finished_events(batch)
    assert event.created_at == later(1)
    assert sweep(now=later(2))["batches_finished"] == 0
    assert len(finished_events(batch)) == 1
    assert_consistent(later(2))


def test_replays_sweeps_and_reconciliation_never_write_a_second_event(worker):
    batch = make_batch(1)
    job = claim(worker)
    _complete(worker, job)

    _complete(worker, job, later(1))  # the worker lost the response: a replay
    sweep(now=later(2))
    reconcile(now=later(3), recount=True)
    transitions.settle(now=later(4))
    transitions.cancel_batch(batch, now=later(5))  # nothing left to cancel

    assert [e.generation for e in finished_events(batch)] == [1]
    assert Batch.objects.get(pk=batch.pk).finishes == 1


def test_retry_reopens_and_the_next_finish_is_a_new_event(worker):
    batch = make_batch(1)
    job = claim(worker)
    transitions.fail(job, job.lease_token, worker=worker, error="x", retryable=False)
    [first] = finished_events(batch)

    assert transitions.retry_failed(Job.objects.filter(batch=batch), now=later(1)) == 1
    assert Batch.objects.get(pk=batch.pk).finished_at is None
    _complete(worker, claim(worker, later(2)), later(3))

    second = finished_events(batch)[1]
    assert (first.generation, second.generation) == (1, 2)
    assert second.webhook_id != first.webhook_id
    assert _body(second)["data"]["batch"]["counts"] == {**COUNTS_ZERO, "done": 1}
    batch.refresh_from_db()
    assert (batch.finishes, batch.finished_at) == (2, later(3))


def test_the_unique_key_refuses_a_second_event_of_one_finish(worker):
    batch = make_batch(1)
    _complete(worker, claim(worker))
    assert len(finished_events(batch)) == 1

    with pytest.raises(DatabaseError):  # IntegrityError, a DatabaseError
        WebhookEvent.objects.create(
            webhook_id="msg_forged",
            type="batch.finished",
            batch=batch,
            generation=1,
            created_at=T0,
            body="{}",
        )


def _finish_by(path: str, worker):
    """A batch one transition away from finishing, and that transition."""
    if path == "reclaim":
        with override_settings(RECALL_MAX_ATTEMPTS=1):
            batch = make_batch(1)
    else:
        batch = make_batch(1)
    job = claim(worker) if path in ("complete", "fail", "reclaim", "cancel") else None
    if path == "cancel":  # the operator's cancel marked it; a chunk finishes it
        Batch.objects.filter(pk=batch.pk).update(cancelled_at=T0)
    actions = {
        "complete": lambda: _complete(worker, job, later(1)),
        "fail": lambda: transitions.fail(
            job, job.lease_token, worker=worker, error="x", retryable=False
        ),
        "reclaim": lambda: transitions.reclaim_expired(now=later(61)),
        "cancel": lambda: transitions.cancel_batch_chunk(batch.pk, now=later(1)),
        "cancel_job": lambda: transitions.cancel_job(jobs_of(batch)[0], now=T0),
    }
    return batch, actions[path]


PATHS = ["complete", "fail", "reclaim", "cancel", "cancel_job"]
OUTBOX_WRITES = [
    ("jobs_webhookevent", "INSERT"),
    ("jobs_webhookdelivery", "INSERT"),
    ("batches_batch", "UPDATE"),
]


@pytest.mark.parametrize("write", OUTBOX_WRITES, ids=lambda w: "-".join(w))
@pytest.mark.parametrize("path", PATHS)
def test_if_the_event_cannot_be_written_the_finishing_transition_changes_nothing(
    path, write, worker
):
    make_endpoint()
    batch, finish = _finish_by(path, worker)
    jobs = jobs_of(batch)
    before = snapshot(*jobs)
    events = WebhookEvent.objects.count()

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        finish()

    assert snapshot(*jobs) == before
    assert WebhookEvent.objects.count() == events
    assert not WebhookDelivery.objects.exists()
    # Once the database takes writes again, the same transition finishes it.
    finish()
    assert len(finished_events(batch)) == 1
    assert WebhookDelivery.objects.count() == 1


def test_if_the_sweep_cannot_write_the_event_the_batch_stays_unfinished(worker):
    batch = make_batch(1)
    [job] = jobs_of(batch)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED, finished_at=T0)
    BatchItem.objects.filter(pk=job.item_id).update(status=ItemStatus.CANCELLED)
    BatchCounter.objects.filter(batch=batch, queued=1).update(queued=0, cancelled=1)

    with (
        failpoint("jobs_webhookevent", "INSERT"),
        pytest.raises(DatabaseError, match="failpoint"),
    ):
        transitions.settle(now=T0)

    batch.refresh_from_db()
    assert (batch.finished_at, batch.finishes) == (None, 0)
    assert transitions.settle(now=T0) == 1


def test_a_completion_that_does_not_finish_takes_no_batch_lock(worker):
    """Outside the tail (items still queued) a completion neither reads the
    batch row for update nor writes it: the hot path stays as it was."""
    batch = make_batch(3)
    job = claim(worker)
    with failpoint("batches_batch", "UPDATE"):
        _complete(worker, job)
    assert Batch.objects.get(pk=batch.pk).finished_at is None


def test_each_backend_finishes_a_batch_its_own_way_with_the_same_rows(worker):
    # (the differential test compares the rows; here: the statement backend's
    # completion in the tail goes the ORM way, and the rows say the same)
    make_endpoint()
    batch = make_batch(2)
    a, b = claim(worker), claim(worker)
    _complete(worker, a)
    _complete(worker, b, later(1))
    assert [e.generation for e in finished_events(batch)] == [1]
    assert connection.vendor in ("postgresql", "sqlite")
    assert_consistent(later(1))


def test_other_batches_are_left_alone(worker):
    other = make_batch(2, name="other")
    batch = make_batch(1, name="mine")
    w2 = make_worker("w2")
    job = transitions.claim_next(w2, now=T0)
    assert job.batch_id in (other.pk, batch.pk)
    for j in [job, *[transitions.claim_next(w2, now=T0) for _ in range(2)]]:
        _complete(w2, j)

    assert {e.batch_id for e in WebhookEvent.objects.all()} == {other.pk, batch.pk}
    assert WebhookEvent.objects.count() == 2


def test_recall_check_reports_a_finish_without_its_event(worker):
    from engine.checks import find_violations

    batch = make_batch(1)
    _complete(worker, claim(worker))
    assert_consistent(later(1))
    WebhookEvent.objects.filter(batch=batch).delete()

    assert [str(v) for v in find_violations(now=later(1))] == [
        f"one-event-per-finish: batch {batch.pk} finished 1 time(s) but has 0 "
        f"batch.finished event(s)"
    ]


@pytest.mark.django_db(transaction=True)
def test_a_hand_off_that_fails_after_the_commit_leaves_the_completion_done(
    monkeypatch, caplog
):
    """The finishing completion's deliveries are handed to the cluster once
    its transaction commits. When that hand-off fails (the database
    restarting behind PgBouncer), the completion has happened all the same:
    it returns, the error is logged, and the delivery waits for the
    dispatcher. The hook was a ``functools.partial``, and Django's log line
    for a failed hook reads its ``__qualname__``: the AttributeError made a
    committed completion a 500."""
    worker = make_worker()
    endpoint = make_endpoint()
    batch = make_batch(1)
    job = claim(worker)

    def broker_down(*args, **kwargs):
        raise OperationalError("server conn crashed?")

    monkeypatch.setattr(outbox, "async_task", broker_down)
    with caplog.at_level(logging.ERROR):
        _complete(worker, job, later(1))

    [event] = finished_events(batch)
    [delivery] = WebhookDelivery.objects.filter(event=event)
    assert (delivery.endpoint_id, delivery.status, delivery.attempts) == (
        endpoint.pk,
        "pending",
        0,
    )
    assert delivery.next_attempt_at == later(1)
    assert Job.objects.get(pk=job.pk).status == JobStatus.COMPLETED
    [record] = [r for r in caplog.records if "in on_commit()" in r.getMessage()]
    assert "server conn crashed?" in record.getMessage()
