"""A batch's archive before a purge deletes it: ``batch-<id>.jsonl.gz``.

One gzipped JSON Lines file per batch: first ``{"batch": {...}}`` (what the
batch was), then one line per item exactly as the JSON Lines export writes it
(``batches.exports.jsonl_lines``), then ``{"lease": {...}}`` per lease-ledger
row, in id order. Read in keyset chunks like the exports, so a million-item
batch never sits in memory.

The purge deletes a batch only once its archive is safe, so it trusts no file
it did not write itself, now: the archive is written to a new temporary file
(created exclusively, mode 600), synced, and linked under its final name,
which fails if anything (a file, a link, a directory) already has that name;
the name is never replaced. Its SHA-256 is computed while it is written and
checked again on the file under the final name (the same inode) before the
purge goes on, and the purge's report records it. A name already taken stops
the purge with a clear error (``ArchiveRefused``): a file planted there, or
left by an earlier run, is never taken for this batch's archive.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from batches.exports import CHUNK, jsonl_lines
from batches.models import Batch, BatchItem
from jobs.models import Lease

READ_CHUNK = 1 << 20


class ArchiveRefused(Exception):
    """The archive cannot be written, or what is under its name cannot be
    trusted: nothing of the batch may be deleted. The message says why and
    what to do. ``report`` is set by the purge that stopped on it."""

    report: Any = None


@dataclass(frozen=True)
class Archive:
    """An archive this process wrote and checked: where, and its checksum."""

    path: Path
    sha256: str
    size: int


def archive_path(directory: Path, batch_id: int) -> Path:
    return directory / f"batch-{batch_id}.jsonl.gz"


def write_archive(batch: Batch, directory: Path) -> Archive:
    """Write the batch's archive in ``directory`` and check it; ArchiveRefused
    if its name is taken (whatever by) or the file under the name is not the
    one written."""
    path = archive_path(directory, batch.pk)
    if os.path.lexists(path):
        raise ArchiveRefused(_taken(path, batch.pk))
    descriptor, temporary = tempfile.mkstemp(
        dir=directory, prefix=f".batch-{batch.pk}.", suffix=".tmp"
    )
    digest = hashlib.sha256()
    # Open until checked: the inode cannot be freed and reused meanwhile, so
    # "the same inode" means the same file.
    with os.fdopen(descriptor, "wb") as raw:
        try:
            hashed = _Hashed(raw, digest)
            with gzip.GzipFile(
                filename=path.name, mode="wb", fileobj=hashed, mtime=0
            ) as out:
                for line in archive_lines(batch):
                    out.write(line.encode())
            raw.flush()
            os.fsync(raw.fileno())
            _place(Path(temporary), path, batch.pk)
        finally:
            Path(temporary).unlink(missing_ok=True)
        _fsync_directory(directory)
        archive = Archive(path=path, sha256=digest.hexdigest(), size=hashed.size)
        _verify(archive, os.fstat(raw.fileno()))
    return archive


class _Hashed:
    """A file that also feeds what is written to it to a hash."""

    def __init__(self, raw: Any, digest: Any) -> None:
        self.raw, self.digest, self.size = raw, digest, 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        written: int = self.raw.write(data)
        return written

    def flush(self) -> None:
        self.raw.flush()


def _place(temporary: Path, path: Path, batch_id: int) -> None:
    """Give the written file its final name without ever replacing another.

    A hard link fails when the name exists, atomically. Where the file system
    has no hard links, the name is reserved by an exclusive create (which
    also fails when it exists, and follows no link) and the file renamed over
    that reservation, its own."""
    try:
        os.link(temporary, path)
        return
    except FileExistsError:
        raise ArchiveRefused(_taken(path, batch_id)) from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
            raise
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        os.close(os.open(path, flags, 0o600))
    except FileExistsError:
        raise ArchiveRefused(_taken(path, batch_id)) from None
    os.replace(temporary, path)


def _verify(archive: Archive, written: os.stat_result) -> None:
    """The file under the final name is the one written (same inode, a regular
    file, not a link) and holds exactly what was written."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        descriptor = os.open(archive.path, flags)
    except OSError as error:
        raise ArchiveRefused(_changed(archive, str(error))) from None
    digest = hashlib.sha256()
    with os.fdopen(descriptor, "rb") as placed:
        found = os.fstat(placed.fileno())
        if not stat.S_ISREG(found.st_mode) or (found.st_dev, found.st_ino) != (
            written.st_dev,
            written.st_ino,
        ):
            raise ArchiveRefused(_changed(archive, "another file is under its name"))
        while chunk := placed.read(READ_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != archive.sha256:
        raise ArchiveRefused(_changed(archive, "its content changed"))


def _taken(path: Path, batch_id: int) -> str:
    return (
        f"{path} is already there, and this run did not write it: the purge "
        f"trusts only an archive it has just written, so nothing of batch "
        f"{batch_id} was deleted (and the purge stopped). If an earlier run was "
        f"stopped part-way, that file holds the rows it deleted: move it "
        f"elsewhere (keep it) and run again; the new archive then holds the "
        f"rest."
    )


def _changed(archive: Archive, why: str) -> str:
    return (
        f"{archive.path} was written by this run, but {why} before the purge "
        f"could delete anything: nothing of the batch was deleted (and the purge "
        f"stopped). Is another process writing in the archive directory?"
    )


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


def _line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def _time(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _fsync_directory(directory: Path) -> None:
    """Make the new name itself durable before the rows it saves are deleted."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
