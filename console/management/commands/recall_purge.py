from __future__ import annotations

import json
import math
import os
from datetime import timedelta
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from engine.archive import ArchiveRefused
from engine.retention import PurgeReport, purge


def days(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise CommandError(
            f"--finished-before takes a number of days (e.g. 30), not {value!r}."
        ) from None
    if not math.isfinite(number) or number < 0:
        raise CommandError(
            f"--finished-before must be a finite number of days, 0 or more, "
            f"not {value!r}."
        )
    return number


class Command(BaseCommand):
    help = (
        "Delete the batches finished (or cancelled) more than DAYS days ago, with "
        "their items, jobs, ledger rows, events, counters and throughput rows, a "
        "chunk per transaction. Unfinished batches are never touched. Safe to run "
        "while workers claim; a run killed part-way is finished by the next. "
        "Prints what it did and, last, a JSON report."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--finished-before",
            metavar="DAYS",
            required=True,
            help="delete batches that finished more than DAYS days ago (0: any)",
        )
        parser.add_argument(
            "--archive",
            metavar="DIR",
            help="first write each batch's batch-<id>.jsonl.gz into DIR; a name "
            "already taken there stops the purge (nothing of that batch deleted)",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="list what would be deleted; delete and write nothing",
        )

    def handle(
        self,
        *args,
        finished_before: str,
        archive: str | None,
        dry_run: bool,
        **options,
    ) -> None:
        older_than = timedelta(days=days(finished_before))
        directory = None if archive is None else _archive_directory(archive, dry_run)
        try:
            report = purge(older_than=older_than, archive=directory, dry_run=dry_run)
        except ArchiveRefused as refused:
            # What was done before the stop is reported too, then the error.
            self._report(refused.report)
            raise CommandError(str(refused)) from None
        self._report(report)

    def _report(self, report: PurgeReport) -> None:
        for line in report.lines():
            self.stdout.write(line)
        self.stdout.write(json.dumps(report.as_dict(), sort_keys=True))


def _archive_directory(value: str, dry_run: bool) -> Path:
    if not value.strip():
        raise CommandError("--archive needs a directory.")
    directory = Path(value)
    if directory.exists() and not directory.is_dir():
        raise CommandError(f"--archive {value}: not a directory.")
    if not dry_run:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CommandError(f"--archive {value}: {error.strerror}.") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise CommandError(f"--archive {value}: not writable.")
    return directory
