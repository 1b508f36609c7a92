from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from batches.intake import ManifestInvalid, create_batch, file_lines


class Command(BaseCommand):
    help = (
        "Create a batch from a manifest and print the batch id as the last line. "
        "MANIFEST is a text file with one source per line, or a CSV file with a "
        "'source' column (an optional 'duration_seconds' column feeds the ETA; "
        "other columns become the item's params). Nothing is created if any line "
        "is invalid."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("name")
        parser.add_argument("manifest", help="Path to the manifest file.")
        parser.add_argument(
            "--priority", type=int, default=0, help="Higher runs first (default 0)."
        )

    def handle(self, *args, name: str, manifest: str, priority: int, **options) -> None:
        if not -32768 <= priority <= 32767:
            raise CommandError("--priority must be between -32768 and 32767.")
        try:
            with open(manifest, "rb"):
                pass
        except OSError as error:
            raise CommandError(f"Cannot read {manifest}: {error.strerror}.") from None
        try:
            batch = create_batch(name, file_lines(manifest), priority=priority)
        except ManifestInvalid as invalid:
            raise CommandError(
                f"{manifest} is not a valid manifest; nothing was created.\n{invalid}"
            ) from None
        self.stderr.write(
            f"Created batch {batch.name!r} with {batch.total} items. Its id:"
        )
        self.stdout.write(str(batch.pk))
