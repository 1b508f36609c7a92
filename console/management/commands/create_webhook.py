from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from engine.webhooks.endpoints import EndpointInvalid, create_endpoint


class Command(BaseCommand):
    help = (
        "Create a webhook endpoint and print its signing secret as the last line. "
        "The secret is shown only this once (Recall keeps it encrypted)."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("url", help="http:// or https:// URL of the receiver.")
        parser.add_argument(
            "--events",
            default="batch.finished",
            help="Comma-separated event types: batch.finished (the default), "
            "item.failed.",
        )
        parser.add_argument("--description", default="", help="A note for people.")

    def handle(self, *args, url: str, events: str, description: str, **options):
        if len(description) > 200 or any(not c.isprintable() for c in description):
            raise CommandError(
                "The description must be up to 200 printable characters."
            )
        try:
            endpoint, secret = create_endpoint(
                url, events=events, description=description
            )
        except EndpointInvalid as invalid:
            raise CommandError(f"Refused: {invalid} Nothing was created.") from invalid
        self.stderr.write(
            f"Created webhook endpoint {endpoint.pk} for {endpoint.url} "
            f"({', '.join(endpoint.event_types())}). Its secret:"
        )
        self.stdout.write(secret)
