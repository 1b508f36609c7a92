"""manage.py reencrypt_webhook_secrets: every webhook secret under the current
SECRET_KEY, so the old key can leave SECRET_KEY_FALLBACKS."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from jobs import transitions


class Command(BaseCommand):
    help = (
        "Re-encrypt every webhook endpoint's secret under the current SECRET_KEY "
        "(secrets only a SECRET_KEY_FALLBACKS key decrypts). Run it after "
        "rotating SECRET_KEY, before removing the old key from the fallbacks. "
        "Idempotent; exits 1 if a secret no key decrypts is left (rotate it)."
    )

    def handle(self, *args, **options) -> None:
        report = transitions.reencrypt_webhook_secrets()
        self.stdout.write(
            f"re-encrypted under the current SECRET_KEY: {len(report.changed)} "
            f"endpoint(s); already current: {len(report.current)}"
        )
        self.stdout.write(
            json.dumps(
                {
                    "reencrypted": report.changed,
                    "current": report.current,
                    "unreadable": report.unreadable,
                },
                sort_keys=True,
            )
        )
        if report.unreadable:
            raise CommandError(
                f"No key in SECRET_KEY or SECRET_KEY_FALLBACKS decrypts the secret "
                f"of endpoint(s) {report.unreadable}: rotate their secrets (the "
                f"admin's 'Rotate the secrets' action) and give the receivers the "
                f"new ones."
            )
