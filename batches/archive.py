"""A batch's archive before a purge deletes it: ``batch-<id>.jsonl.gz``.

One gzipped JSON Lines file per batch: first ``{"batch": {...}}`` (what the
batch was), then one line per item exactly as the JSON Lines export writes it
(``batches.exports.jsonl_lines``), then ``{"lease": {...}}`` per lease-ledger
row, in id order. Read in keyset chunks like the exports, so a million-item
batch never sits in memory. Written to a temporary file in the same directory
and renamed into place, so a file under the final name is always whole.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from jobs.models import Lease

from .exports import CHUNK, jsonl_lines
from .models import Batch, BatchItem


def archive_path(directory: Path, batch_id: int) -> Path:
    return directory / f"batch-{batch_id}.jsonl.gz"


def write_archive(batch: Batch, directory: Path) -> Path:
    """The batch's archive in ``directory``; returns its path.

    An archive of the same finish of the batch (``Batch.finishes``) already
    there was written by an earlier purge run before it deleted anything (a
    run killed part-way), so it holds rows the batch no longer has: it is kept.
    One of an earlier finish (the batch was reopened and finished again since)
    is kept under ``batch-<id>.finish-<n>.jsonl.gz`` and a new one written.
    """
    path = archive_path(directory, batch.pk)
    if path.exists():
        finishes = _archived_finishes(path)
        if finishes == batch.finishes:
            return path
        os.replace(path, directory / f"batch-{batch.pk}.finish-{finishes}.jsonl.gz")
    descriptor, temporary = tempfile.mkstemp(
        dir=directory, prefix=f".batch-{batch.pk}.", suffix=".tmp"
    )
    try:
        with os.fdopen(descriptor, "wb") as raw:
            with gzip.GzipFile(
                filename=path.name, mode="wb", fileobj=raw, mtime=0
            ) as out:
                for line in archive_lines(batch):
                    out.write(line.encode())
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    return path


def archive_lines(batch: Batch) -> Iterator[str]:
    yield _line({"batch": _batch_record(batch)})
    yield from jsonl_lines(batch)
    yield from _ledger_lines(batch)


def _batch_record(batch: Batch) -> dict:
    return {
        "id": batch.pk,
        "name": batch.name,
        "priority": batch.priority,
        "weight": batch.weight,
        "max_in_flight": batch.max_in_flight,
        "total": batch.total,
        "total_ms": batch.total_ms,
        "created_at": _time(batch.created_at),
        "created_by": batch.created_by.get_username() if batch.created_by else None,
        "cancelled_at": _time(batch.cancelled_at),
        "finished_at": _time(batch.finished_at),
        "finishes": batch.finishes,
    }


def _ledger_lines(batch: Batch) -> Iterator[str]:
    """The ledger rows of the batch's items, item by item (keyset over the
    batch's items: the ledger has no index by batch)."""
    last = 0
    while True:
        items = list(
            BatchItem.objects.filter(batch=batch, pk__gt=last)
            .order_by("pk")
            .values_list("pk", flat=True)[:CHUNK]
        )
        rows = (
            Lease.objects.filter(job__item_id__in=items)
            .order_by("job__item_id", "pk")
            .values_list(
                "pk",
                "job__item_id",
                "job_id",
                "attempt",
                "worker__name",
                "claimed_at",
                "heartbeat_at",
                "expires_at",
                "ended_at",
                "end_reason",
                "error",
            )
        )
        for row in rows:
            pk, item, job, attempt, worker, claimed, beat, expires, ended = row[:9]
            yield _line(
                {
                    "lease": {
                        "id": pk,
                        "item": item,
                        "job": job,
                        "attempt": attempt,
                        "worker": worker,
                        "claimed_at": _time(claimed),
                        "heartbeat_at": _time(beat),
                        "expires_at": _time(expires),
                        "ended_at": _time(ended),
                        "end_reason": row[9],
                        "error": row[10],
                    }
                }
            )
        if len(items) < CHUNK:
            return
        last = items[-1]


def _archived_finishes(path: Path) -> int | None:
    with gzip.open(path, "rt", encoding="utf-8") as archived:
        first = json.loads(archived.readline())
    finishes: int | None = first["batch"]["finishes"]
    return finishes


def _line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def _time(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable before the rows it saves are deleted."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
