"""What a batch requires of workers (issue 26): stored with the batch by the
creation transition, changed only by ``set_requires`` while the batch is open,
each change an event with who and what."""

from __future__ import annotations

import pytest

from batches.labels import LabelError
from batches.models import Batch
from jobs import transitions
from jobs.exceptions import BatchClosed
from jobs.models import Event
from tests.support.factories import T0, claim, make_batch, make_user

pytestmark = pytest.mark.django_db


def test_create_batch_stores_the_requirements_with_the_batch():
    batch = transitions.create_batch(
        name="routed",
        items=[("file:///a.wav", {}, None)],
        requires={"model": "large-v3", "gpu": "a100"},
        now=T0,
    )

    batch.refresh_from_db()
    assert batch.requires == {"gpu": "a100", "model": "large-v3"}
    assert make_batch(1, name="plain").requires == {}


def test_bad_requirements_create_nothing():
    with pytest.raises(LabelError, match="requires: key 'GPU' must be"):
        transitions.create_batch(
            name="bad", items=[("file:///a.wav", {}, None)], requires={"GPU": "x"}
        )
    assert not Batch.objects.exists()


def test_requirements_commit_or_roll_back_with_the_batch():
    def items():
        yield ("file:///a.wav", {}, None)
        raise RuntimeError("the manifest went away")

    with pytest.raises(RuntimeError):
        transitions.create_batch(
            name="half", items=items(), requires={"gpu": "a100"}, now=T0
        )
    assert not Batch.objects.exists()


def test_set_requires_changes_them_and_records_who_and_what():
    operator = make_user("ops")
    batch = make_batch(2)

    change = transitions.set_requires(
        batch, {"model": "large-v3", "gpu": "a100"}, actor=operator, now=T0
    )

    assert change == "requires nothing -> gpu=a100, model=large-v3"
    assert batch.requires == {"gpu": "a100", "model": "large-v3"}  # refreshed
    assert Batch.objects.get(pk=batch.pk).requires == batch.requires
    event = Event.objects.get(kind=Event.Kind.BATCH_CHANGED)
    assert (event.batch_id, event.actor, event.created_at) == (batch.pk, operator, T0)
    assert event.message == "Changed requires nothing -> gpu=a100, model=large-v3."

    assert transitions.set_requires(batch, {"gpu": "a100", "model": "large-v3"}) is None
    assert transitions.set_requires(batch, {}, now=T0) == (
        "requires gpu=a100, model=large-v3 -> nothing"
    )
    assert Event.objects.filter(kind=Event.Kind.BATCH_CHANGED).count() == 2


def test_bad_requirements_change_nothing():
    batch = make_batch(1)
    with pytest.raises(LabelError, match="value of 'gpu' must be"):
        transitions.set_requires(batch, {"gpu": "a 100"})
    with pytest.raises(LabelError, match="at most 16 labels, got 17"):
        transitions.set_requires(batch, {f"k{i}": "v" for i in range(17)})
    assert Batch.objects.get(pk=batch.pk).requires == {}
    assert not Event.objects.exists()


def test_a_closed_batch_keeps_its_requirements(worker):
    cancelled = make_batch(1, name="cancelled")
    transitions.cancel_batch(cancelled, now=T0)
    finished = make_batch(1, name="finished")
    job = claim(worker, now=T0)
    transitions.complete(job, job.lease_token, worker=worker, result={}, now=T0)
    finished.refresh_from_db()
    assert finished.finished_at is not None

    with pytest.raises(BatchClosed, match=f"Batch {cancelled.pk} is cancelled: its"):
        transitions.set_requires(cancelled, {"gpu": "a100"}, now=T0)
    with pytest.raises(BatchClosed, match=f"Batch {finished.pk} is finished: its"):
        transitions.set_requires(finished, {"gpu": "a100"}, now=T0)
    assert [b.requires for b in Batch.objects.order_by("pk")] == [{}, {}]
    assert not Event.objects.filter(kind=Event.Kind.BATCH_CHANGED).exists()


def test_a_paused_batch_is_open_to_the_change():
    batch = make_batch(1)
    transitions.pause_batch(batch, now=T0)
    assert transitions.set_requires(batch, {"gpu": "a100"}, now=T0)
