"""A purge with ``--archive DIR`` deletes a batch only after an archive it has
just written itself: a file planted under the archive's name (or a link, or a
directory, or one that appears while the archive is written, or replaces it
afterwards) stops the purge with a clear error and deletes nothing of that
batch. Every archive's SHA-256 is recorded in the report."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from engine import archive as archives
from engine.archive import ArchiveRefused, archive_path
from engine.retention import purge
from tests.support.factories import T0
from tests.support.purge import DAY, GONE, finished_batch, rows_of

pytestmark = pytest.mark.django_db

NOW = T0 + 2 * DAY


def forged_archive(batch) -> bytes:
    """What an attacker plants: a well-formed archive of the right finish,
    holding none of the batch's items (the purge before this fix kept it)."""
    head = {"batch": {"id": batch.pk, "name": "forged", "finishes": batch.finishes}}
    return gzip.compress((json.dumps(head) + "\n").encode(), mtime=0)


def test_a_planted_archive_is_not_trusted_and_nothing_is_deleted(worker, tmp_path):
    batch = finished_batch(worker, 3)
    planted = archive_path(tmp_path, batch.pk)
    planted.write_bytes(forged_archive(batch))
    before = rows_of(batch.pk)

    with pytest.raises(ArchiveRefused) as refused:
        purge(older_than=DAY, now=NOW, archive=tmp_path)

    assert str(refused.value).startswith(f"{planted} is already there, and this run")
    assert f"nothing of batch {batch.pk} was deleted" in str(refused.value)
    assert rows_of(batch.pk) == before
    assert planted.read_bytes() == forged_archive(batch)  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == [planted.name]  # no temp
    assert refused.value.report.batches == []


def test_a_link_or_a_directory_under_the_name_is_refused_too(worker, tmp_path):
    batch = finished_batch(worker, 2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "victim.txt"
    victim.write_text("not yours")
    directory = tmp_path / "archives"
    directory.mkdir()
    name = archive_path(directory, batch.pk)

    for taken in ("dangling", "link", "directory"):
        if taken == "dangling":
            name.symlink_to(elsewhere / "nothing-here")
        elif taken == "link":
            name.symlink_to(victim)
        else:
            name.mkdir()
        with pytest.raises(ArchiveRefused, match="is already there"):
            purge(older_than=DAY, now=NOW, archive=directory)
        assert rows_of(batch.pk)["jobs"] == 2, taken
        assert victim.read_text() == "not yours"
        assert not (elsewhere / "nothing-here").exists()
        if name.is_symlink():
            name.unlink()
        else:
            name.rmdir()
    assert list(directory.iterdir()) == []


def test_a_name_taken_while_the_archive_is_written_is_refused(
    worker, tmp_path, monkeypatch
):
    batch = finished_batch(worker, 3)
    planted = archive_path(tmp_path, batch.pk)
    lines = archives.archive_lines

    def racing(b):
        for n, line in enumerate(lines(b)):
            if n == 1:  # the attacker wins the race after the first check
                planted.write_bytes(forged_archive(b))
            yield line

    monkeypatch.setattr(archives, "archive_lines", racing)
    with pytest.raises(ArchiveRefused, match="is already there"):
        purge(older_than=DAY, now=NOW, archive=tmp_path)

    assert rows_of(batch.pk)["jobs"] == 3
    assert planted.read_bytes() == forged_archive(batch)
    assert sorted(p.name for p in tmp_path.iterdir()) == [planted.name]


@pytest.mark.parametrize(
    ("change", "why"),
    [("replace", "another file is under its name"), ("rewrite", "content changed")],
)
def test_an_archive_changed_after_it_was_written_is_refused(
    worker, tmp_path, monkeypatch, change, why
):
    batch = finished_batch(worker, 3)
    path = archive_path(tmp_path, batch.pk)
    sync = archives._fsync_directory

    def tampered(directory):
        sync(directory)
        if change == "replace":  # another inode under the name
            path.unlink()
            path.write_bytes(forged_archive(batch))
        else:  # the same inode, other bytes
            with open(path, "r+b") as same:
                same.write(forged_archive(batch))

    monkeypatch.setattr(archives, "_fsync_directory", tampered)
    with pytest.raises(ArchiveRefused, match=why):
        purge(older_than=DAY, now=NOW, archive=tmp_path)

    assert rows_of(batch.pk)["jobs"] == 3


def test_each_archive_is_checked_and_its_checksum_recorded(worker, tmp_path):
    first = finished_batch(worker, 2, name="first")
    second = finished_batch(worker, 3, name="second", at=T0 + DAY / 2)

    report = purge(older_than=DAY, now=NOW, archive=tmp_path)

    assert report.batches == [first.pk, second.pk]
    paths = [str(archive_path(tmp_path, b.pk)) for b in (first, second)]
    assert report.archives == paths
    assert report.archive_sha256 == {
        p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths
    }
    assert report.as_dict()["archive_sha256"] == report.archive_sha256
    assert report.as_dict()["stopped"] == ""
    assert [f"archive {p}: sha256 {report.archive_sha256[p]}" for p in paths] == (
        report.lines()[-2:]
    )
    assert all(oct(os.stat(p).st_mode & 0o777) == "0o600" for p in paths)


def test_the_command_stops_with_a_clear_error_after_reporting_what_it_did(
    worker, tmp_path
):
    done = finished_batch(worker, 2, name="done")
    blocked = finished_batch(worker, 2, name="blocked", at=T0 + DAY / 4)
    later = finished_batch(worker, 2, name="later", at=T0 + DAY / 2)
    archive_path(tmp_path, blocked.pk).write_bytes(forged_archive(blocked))
    out = io.StringIO()

    with pytest.raises(CommandError, match=r"is already there, and this run did"):
        call_command(
            "recall_purge", "--finished-before", "1", "--archive", str(tmp_path),
            stdout=out,
        )  # fmt: skip

    report = json.loads(out.getvalue().splitlines()[-1])
    assert report["batch_ids"] == [done.pk]
    assert list(report["archive_sha256"]) == [str(archive_path(tmp_path, done.pk))]
    assert report["stopped"].startswith(str(archive_path(tmp_path, blocked.pk)))
    assert rows_of(done.pk) == GONE
    assert rows_of(blocked.pk)["jobs"] == 2
    assert rows_of(later.pk)["jobs"] == 2  # the run stopped: nothing after it
