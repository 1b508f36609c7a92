from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from jobs import transitions
from jobs.models import Worker


class Command(BaseCommand):
    help = (
        "Create a worker and print its API token as the last line. The token is "
        "shown only this once: Recall stores only its hash."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("name", help="A unique name, e.g. the GPU box's hostname.")

    def handle(self, *args, name: str, **options) -> None:
        name = name.strip()
        if not name or len(name) > 100 or any(ord(c) < 32 for c in name):
            raise CommandError("The name must be 1 to 100 printable characters.")
        if Worker.objects.filter(name=name).exists():
            raise CommandError(f"A worker named {name!r} already exists.")
        worker, token = transitions.create_worker(name)
        self.stderr.write(
            f"Created worker {worker.name!r} (id {worker.pk}). Its token:"
        )
        self.stdout.write(token)
