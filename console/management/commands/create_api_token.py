"""manage.py create_api_token USERNAME [--name LABEL] [--expires-days N]: a
personal API token for the operator API, printed once as the last line (only
its hash is stored), refused after N days if given."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from jobs import transitions
from operator_api import tokens
from operator_api.models import MAX_EXPIRY_DAYS, MAX_LABEL_CHARS


class Command(BaseCommand):
    help = (
        "Create a personal API token for USERNAME (it carries that user's "
        "permissions); the token is printed once, as the last line."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="A label, e.g. 'nightly'.")
        parser.add_argument(
            "--expires-days",
            metavar="N",
            default=None,
            help=f"Refuse the token after N days (1 to {MAX_EXPIRY_DAYS}); "
            f"without it, the token lasts until it is revoked.",
        )

    def handle(
        self, *args, username: str, name: str, expires_days: str | None, **options
    ) -> None:
        days = _days(expires_days)
        name = name.strip()
        if len(name) > MAX_LABEL_CHARS or any(ord(c) < 32 for c in name):
            raise CommandError(
                f"--name must be at most {MAX_LABEL_CHARS} printable characters."
            )
        User = get_user_model()
        user = User.objects.filter(**{User.USERNAME_FIELD: username}).first()
        if user is None:
            raise CommandError(f"There is no user {username!r}.")
        if not user.is_active:
            raise CommandError(f"User {username!r} is deactivated.")
        api_token, token = tokens.issue_token(
            user, label=name, now=transitions.now(), expires_in_days=days
        )
        until = (
            ""
            if api_token.expires_at is None
            else f", valid until {api_token.expires_at.isoformat()}"
        )
        self.stderr.write(
            f"Created API token {api_token.pk} for {username!r}{until}; it is "
            f"shown once:"
        )
        self.stdout.write(token)


def _days(value: str | None) -> int | None:
    if value is None:
        return None
    text = str(value).strip()
    # Digits only, and few: int() of thousands of digits raises, of more hangs.
    if not (text.isascii() and text.isdigit() and len(text) <= 5) or not (
        1 <= int(text) <= MAX_EXPIRY_DAYS
    ):
        raise CommandError(
            f"--expires-days takes a whole number of days from 1 to "
            f"{MAX_EXPIRY_DAYS}, not {value!r}."
        )
    return int(text)
