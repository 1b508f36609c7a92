"""Background intake: a large manifest uploaded through the web form is stored,
then checked and turned into a batch by the django-q2 cluster, while the
operator's page shows how far it has got.

A million-item manifest takes about a minute to check and write: longer than a
web request may take (gunicorn's timeout is 60 s) and longer than a web thread
should be held. The request only stores the file (in the database, so the
cluster may run on another host) and answers at once; ``run_intake`` does the
rest with the same ``create_batch`` as the command and the small-form path.

Safe to run twice: an intake is claimed by compare-and-set, and the batch and
the intake's "done" commit in one transaction (``create_batch``'s
``on_created``), so a re-delivered task finds it done and does nothing. Each
claim counts an attempt, and a run writes its outcome only while the intake is
still its attempt's (a fence, as a lease token is): a run that was taken over
for being stale and then finished anyway rolls its batch back.

Nothing waits for good: a task can be lost between the commit that stores the
intake and the broker (the hand-off failed after the commit), or with a cluster
killed mid-run. The sweep queues any intake that has not moved for
``stale_after()`` again (``requeue_stranded``); a task that was only late finds
it taken and does nothing.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import IO, Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction
from django.db.models import F, Q

from batches.intake_records import Intake, IntakeChunk, IntakePhase, IntakeStatus
from batches.labels import clean_labels
from batches.models import Batch
from engine.manifests import ManifestInvalid, check_name, create_batch
from jobs import transitions

log = logging.getLogger("recall.intake")

# The manifest is stored in pieces of this size.
CHUNK_BYTES = 1024 * 1024
# How often a running intake records its progress (and that it is alive).
PROGRESS_SECONDS = 1.0
TASK = "engine.tasks.run_intake"


def stale_after() -> timedelta:
    """A queued or running intake that has not moved for this long was
    interrupted (the cluster stopped): the ORM broker delivers its task again
    after ``retry`` seconds, and then it may be taken over."""
    return timedelta(seconds=settings.Q_CLUSTER.get("retry", 300))


def start_intake(
    name: str,
    upload: UploadedFile,
    *,
    priority: int = 0,
    weight: int = 1,
    max_in_flight: int | None = None,
    created_by=None,
    now: datetime | None = None,
    requires: Mapping[str, str] | None = None,
) -> Intake:
    """Store the upload and queue its intake; return the Intake to follow.

    Raises ManifestInvalid (nothing stored) for a bad name; the manifest's own
    lines are checked by the cluster.
    """
    name = check_name(name)
    now = now or transitions.now()
    with transaction.atomic():
        intake = Intake.objects.create(
            name=name,
            priority=priority,
            weight=weight,
            max_in_flight=max_in_flight,
            requires=clean_labels(requires, what="requires"),
            created_by=created_by,
            created_at=now,
            updated_at=now,
            size_bytes=upload.size or 0,
        )
        upload.seek(0)
        seq = 0
        while data := upload.read(CHUNK_BYTES):
            IntakeChunk.objects.create(intake=intake, seq=seq, data=data)
            seq += 1
        enqueue_on_commit([intake.pk])
    return intake


def enqueue(intake_id: int) -> None:
    from django_q.tasks import async_task

    async_task(TASK, intake_id, task_name=f"intake-{intake_id}")


def enqueue_on_commit(intake_ids: list[int]) -> None:
    """The tasks get their ids once the rows they need are committed. The hook
    is robust: a hand-off that fails then (the broker unreachable) is logged,
    and the committed intake waits for the sweep's ``requeue_stranded``
    instead of failing the request that stored it."""

    def enqueue_intakes() -> None:
        for intake_id in intake_ids:
            enqueue(intake_id)

    transaction.on_commit(enqueue_intakes, robust=True)


def requeue_stranded(*, now: datetime, limit: int = 100) -> list[int]:
    """Queue the task again for each intake (up to ``limit``, oldest first)
    that is queued or running and has not moved for ``stale_after()``: its
    task never reached the broker, or the cluster running it died. Each is
    queued again (a running one goes back to queued, its attempt over) and
    stamped ``now``, so it is queued at most once per ``stale_after()``; a
    task that was only waiting in the broker then finds it taken, or done,
    and does nothing. Returns the ids queued again."""
    stranded = Q(
        status__in=(IntakeStatus.QUEUED, IntakeStatus.RUNNING),
        updated_at__lt=now - stale_after(),
    )
    with transaction.atomic():
        ids = list(
            Intake.objects.filter(stranded)
            .select_for_update(skip_locked=True)
            .order_by("updated_at", "pk")
            .values_list("pk", flat=True)[:limit]
        )
        Intake.objects.filter(pk__in=ids).update(
            status=IntakeStatus.QUEUED, updated_at=now
        )
        if ids:
            enqueue_on_commit(ids)
    if ids:
        log.warning("intakes %s had not moved for %s: queued again", ids, stale_after())
    return ids


def run_intake(intake_id: int, *, now: datetime | None = None) -> str:
    """The cluster's part: check the manifest, create the batch; the outcome."""
    now = now or transitions.now()
    claimed = (
        Intake.objects.filter(pk=intake_id)
        .filter(
            Q(status=IntakeStatus.QUEUED)
            | Q(status=IntakeStatus.RUNNING, updated_at__lt=now - stale_after())
        )
        .update(
            status=IntakeStatus.RUNNING,
            phase=IntakePhase.CHECKING,
            attempts=F("attempts") + 1,
            checked_bytes=0,
            checked_lines=0,
            updated_at=now,
        )
    )
    if not claimed:
        return "skipped: not queued (done, failed, or running elsewhere)"
    # This run's attempt: what it writes in the end, it writes only while the
    # intake is still this attempt's (``_Superseded``).
    intake = Intake.objects.select_related("created_by").get(pk=intake_id)
    with tempfile.TemporaryFile() as spool:
        _download(intake, spool)
        try:
            batch = create_batch(
                intake.name,
                _Progress(intake, spool).opener(),
                priority=intake.priority,
                weight=intake.weight,
                max_in_flight=intake.max_in_flight,
                created_by=intake.created_by,
                on_created=lambda batch: _finish(intake, batch),
                requires=intake.requires,
            )
        except _Superseded:
            return _superseded(intake)
        except ManifestInvalid as invalid:
            if not _fail(intake, errors=invalid.errors, total=invalid.total_errors):
                return _superseded(intake)
            return f"failed: {invalid.total_errors} problem(s)"
        except Exception as error:
            log.exception("intake %s failed", intake_id)
            if not _fail(intake, detail=f"The intake failed unexpectedly ({error!r})."):
                return _superseded(intake)
            return "failed: unexpected error"
    log.info("intake %s created batch %s (%s items)", intake_id, batch.pk, batch.total)
    return f"done: batch {batch.pk}"


def _download(intake: Intake, spool: IO[bytes]) -> None:
    """The stored manifest into a local file: both of intake's passes read it
    there (the second runs inside a COPY, when the connection is busy)."""
    chunks = (
        IntakeChunk.objects.filter(intake=intake)
        .order_by("seq")
        .values_list("data", flat=True)
    )
    for data in chunks.iterator(chunk_size=4):
        spool.write(data)


class _Progress:
    """Opens the spooled manifest for ``create_batch``: the first pass (the
    check, outside any transaction) records how far it has got every
    PROGRESS_SECONDS; the second (the writes) is left alone."""

    def __init__(self, intake: Intake, spool: IO[bytes]):
        self.intake, self.spool = intake, spool
        self.passes = 0

    def opener(self) -> Callable[[], Iterator[bytes]]:
        def open_manifest() -> Iterator[bytes]:
            self.passes += 1
            self.spool.seek(0)
            return self._checking() if self.passes == 1 else iter(self.spool)

        return open_manifest

    def _checking(self) -> Iterator[bytes]:
        read = lines = 0
        last = time.monotonic()
        for line in self.spool:
            read += len(line)
            lines += 1
            yield line
            if time.monotonic() - last >= PROGRESS_SECONDS:
                self._save(read, lines, IntakePhase.CHECKING)
                last = time.monotonic()
        self._save(read, lines, IntakePhase.WRITING)

    def _save(self, read: int, lines: int, phase: str) -> None:
        Intake.objects.filter(pk=self.intake.pk).update(
            checked_bytes=read,
            checked_lines=lines,
            phase=phase,
            updated_at=transitions.now(),
        )


class _Superseded(Exception):
    """The intake is no longer this run's attempt: raised inside
    create_batch's transaction, it rolls the batch back."""


def _superseded(intake: Intake) -> str:
    log.warning(
        "intake %s: attempt %s was taken over; its outcome is dropped",
        intake.pk,
        intake.attempts,
    )
    return "skipped: taken over by a later attempt"


def _ours(intake: Intake) -> Any:
    """The intake's row while it is still this run's attempt."""
    return Intake.objects.filter(
        pk=intake.pk, status=IntakeStatus.RUNNING, attempts=intake.attempts
    )


def _finish(intake: Intake, batch: Batch) -> None:
    """Inside create_batch's transaction: the intake is done with the batch,
    if it is still this attempt's (else _Superseded, and nothing is kept)."""
    if not _ours(intake).update(
        status=IntakeStatus.DONE, batch=batch, updated_at=transitions.now()
    ):
        raise _Superseded
    IntakeChunk.objects.filter(intake=intake).delete()


def _fail(intake: Intake, *, errors=(), total: int = 0, detail: str = "") -> bool:
    """The intake failed, if it is still this attempt's (else False, and the
    later attempt's run decides)."""
    with transaction.atomic():
        if not _ours(intake).update(
            status=IntakeStatus.FAILED,
            errors=[{"line": e.line, "message": e.message} for e in errors],
            total_errors=total,
            detail=detail,
            updated_at=transitions.now(),
        ):
            return False
        IntakeChunk.objects.filter(intake=intake).delete()
    return True
