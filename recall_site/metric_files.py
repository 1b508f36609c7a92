"""prometheus_client's multiprocess mode under gunicorn.

Each gunicorn worker keeps its request metrics in files of its own in
``PROMETHEUS_MULTIPROC_DIR`` (``counter_<pid>.db``, ``histogram_<pid>.db``);
a scrape, answered by whichever worker, merges every file. gunicorn.conf.py
empties the directory when the server starts (``prepare``), so a restart does
not count old requests again, and hands each worker that exits to ``retire``.

A worker that exits (``max_requests`` recycles them, a crash kills them) leaves
its files behind, and its counts must stay in the totals: counters never go
down. Left alone, those files pile up, and thousands of them make every scrape
slow (prometheus/client_python #204, #367). ``retire`` therefore folds a dead
worker's counters and histograms into one archive file per type and deletes
its files, so the directory holds the live workers' files and two archives.
Scrapes take a shared lock on the directory while they read it and ``retire``
an exclusive one, so no scrape sees a count twice or not at all.

Standard library and prometheus_client only: gunicorn's master runs this, and
it never sets Django up for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
from collections.abc import Iterator

from prometheus_client import multiprocess
from prometheus_client.mmap_dict import MmapedDict, mmap_key

ENV = "PROMETHEUS_MULTIPROC_DIR"
LOCK_FILE = ".lock"
# Types whose values add up across processes; gauges are not used by Recall
# (``mark_process_dead`` takes care of live gauges all the same).
SUMMED = ("counter", "histogram", "summary")
ARCHIVE = "archive"  # <type>_archive.db


def directory() -> str | None:
    """The multiprocess directory, or None when this process serves alone."""
    return os.environ.get(ENV) or None


def prepare(path: str) -> None:
    """Create the directory if need be and delete every metrics file in it:
    whatever a previous server left there is not this server's count."""
    os.makedirs(path, exist_ok=True)
    with _locked(path, fcntl.LOCK_EX):
        for name in glob.glob(os.path.join(path, "*.db")):
            os.remove(name)


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """Hold while merging the files for a scrape."""
    with _locked(path, fcntl.LOCK_SH):
        yield


def retire(pid: int, path: str) -> None:
    """A worker exited: fold its summed metrics into the archives, delete its
    files, and mark it dead for prometheus_client's live gauges."""
    multiprocess.mark_process_dead(pid, path)
    with _locked(path, fcntl.LOCK_EX):
        for kind in SUMMED:
            dead = os.path.join(path, f"{kind}_{pid}.db")
            if not os.path.exists(dead):
                continue
            archive = os.path.join(path, f"{kind}_{ARCHIVE}.db")
            _write(
                multiprocess.MultiProcessCollector.merge(
                    [f for f in (archive, dead) if os.path.exists(f)],
                    accumulate=False,  # raw bucket counts, as the files hold them
                ),
                archive,
            )
            os.remove(dead)


def _write(metrics, archive: str) -> None:
    """Write merged metrics as a fresh file, then put it in the archive's place
    (the temporary name does not end in .db: no scrape reads it half-written)."""
    temporary = archive + ".new"
    with contextlib.suppress(FileNotFoundError):
        os.remove(temporary)
    values = MmapedDict(temporary)
    try:
        for metric in metrics:
            for sample in metric.samples:
                key = mmap_key(
                    metric.name,
                    sample.name,
                    list(sample.labels),
                    list(sample.labels.values()),
                    metric.documentation,
                )
                values.write_value(key, sample.value, sample.timestamp or 0.0)
    finally:
        values.close()
    os.replace(temporary, archive)


@contextlib.contextmanager
def _locked(path: str, how: int) -> Iterator[None]:
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # closing releases the lock
