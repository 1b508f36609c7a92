from __future__ import annotations

import json

from django.core.management.base import BaseCommand

from engine.sweep import sweep


class Command(BaseCommand):
    help = (
        "Run one sweep: reclaim expired leases, reconcile jobs with their items and "
        "the lease ledger, mark finished batches. Prints what it did. Safe to run "
        "while the scheduled sweeper and workers are running."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--full",
            action="store_true",
            help="Check every job and recount every batch's counters (as at start-up).",
        )

    def handle(self, *args, full: bool, **options) -> None:
        report = sweep(full=full)
        reclaimed = report["reclaimed"]
        self.stdout.write(
            f"reclaimed: {reclaimed['requeued']} requeued, {reclaimed['failed']} failed"
        )
        reconcile = report["reconcile"]
        if isinstance(reconcile, str):
            self.stdout.write(f"reconcile: {reconcile}")
        else:
            healed = ", ".join(f"{k} {v}" for k, v in reconcile.items())
            self.stdout.write(f"reconcile: {healed}")
            self.stdout.write(f"batches finished: {report['batches_finished']}")
            self.stdout.write(f"intakes queued again: {report['intakes_requeued']}")
        self.stdout.write(json.dumps(report, sort_keys=True))
