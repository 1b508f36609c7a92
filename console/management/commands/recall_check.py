from __future__ import annotations

from django.core.management.base import BaseCommand

from engine.checks import find_violations


class Command(BaseCommand):
    help = (
        "Check Recall's invariants (read-only; safe in production). Prints each "
        "violation and a summary line; exits 1 if anything is wrong."
    )

    def handle(self, *args, **options) -> None:
        violations = find_violations()
        for violation in violations:
            self.stdout.write(str(violation))
        if violations:
            checks = len({v.check for v in violations})
            self.stdout.write(
                f"recall_check: {len(violations)} violation(s) in {checks} check(s)"
            )
            raise SystemExit(1)
        self.stdout.write("recall_check: ok, no violations")
