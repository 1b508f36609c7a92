"""manage.py create_api_token USERNAME [--name LABEL]: a personal API token for
the operator API, printed once as the last line (only its hash is stored)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from jobs import transitions
from operator_api import tokens
from operator_api.models import MAX_LABEL_CHARS


class Command(BaseCommand):
    help = (
        "Create a personal API token for USERNAME (it carries that user's "
        "permissions); the token is printed once, as the last line."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="A label, e.g. 'nightly'.")

    def handle(self, *args, username: str, name: str, **options) -> None:
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
        api_token, token = tokens.issue_token(user, label=name, now=transitions.now())
        self.stderr.write(
            f"Created API token {api_token.pk} for {username!r}; it is shown once:"
        )
        self.stdout.write(token)
