from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from batches.labels import LabelError, parse_pairs
from batches.models import MAX_IN_FLIGHT, MAX_WEIGHT
from batches.numbers import whole_number
from engine.manifests import ManifestInvalid, create_batch, file_lines


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
        parser.add_argument(
            "--weight",
            default="1",
            help=f"Share of the workers among open batches of the same priority, "
            f"1 to {MAX_WEIGHT} (default 1).",
        )
        parser.add_argument(
            "--require",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="A worker label a worker must offer, with exactly this value, to "
            "take the batch's jobs (repeatable; default: any worker).",
        )
        parser.add_argument(
            "--max-in-flight",
            default=None,
            help="At most this many items in flight at once (default: no cap).",
        )

    def handle(
        self,
        *args,
        name: str,
        manifest: str,
        priority: int,
        weight: str,
        max_in_flight: str | None,
        require: list[str],
        **options,
    ) -> None:
        if not -32768 <= priority <= 32767:
            raise CommandError("--priority must be between -32768 and 32767.")
        weight_value = _whole_number(weight)
        if weight_value is None or not 1 <= weight_value <= MAX_WEIGHT:
            raise CommandError(
                f"--weight must be a whole number from 1 to {MAX_WEIGHT}, "
                f"not {weight!r}."
            )
        cap = None
        if max_in_flight is not None:
            cap = _whole_number(max_in_flight)
            if cap is None or not 1 <= cap <= MAX_IN_FLIGHT:
                raise CommandError(
                    f"--max-in-flight must be a whole number from 1 to "
                    f"{MAX_IN_FLIGHT}, not {max_in_flight!r}."
                )
        try:
            requires = parse_pairs(require, what="--require")
        except LabelError as error:
            raise CommandError(f"{error}.") from None
        try:
            with open(manifest, "rb"):
                pass
        except OSError as error:
            raise CommandError(f"Cannot read {manifest}: {error.strerror}.") from None
        try:
            batch = create_batch(
                name,
                file_lines(manifest),
                priority=priority,
                weight=weight_value,
                max_in_flight=cap,
                requires=requires,
            )
        except ManifestInvalid as invalid:
            raise CommandError(
                f"{manifest} is not a valid manifest; nothing was created.\n{invalid}"
            ) from None
        self.stderr.write(
            f"Created batch {batch.name!r} with {batch.total} items. Its id:"
        )
        self.stdout.write(str(batch.pk))


def _whole_number(text: str) -> int | None:
    """``text`` as a whole number written in plain digits, else None."""
    number = whole_number(text.strip())
    return number if number is not None and number < 10**9 else None
