"""An index on the webhook outbox's item column, for deleting items (retention).

``item.failed`` events point at their item. Deleting an item makes PostgreSQL
check that no event points at it, row by row: without an index that is a scan
of the whole outbox per deleted item, and a purge deletes items by the
million. Only ``item.failed`` events have an item, so the index is partial.

Declared in ``WebhookEvent.Meta.indexes``; built here by hand so that on
PostgreSQL it is built ``CONCURRENTLY``, and a big outbox is not locked against
writes meanwhile.
"""

from django.db import migrations, models

INDEX = "webhook_event_item"


def create(apps, schema_editor):
    concurrently = (
        " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    )
    schema_editor.execute(
        f"CREATE INDEX{concurrently} IF NOT EXISTS {INDEX} "
        f"ON jobs_webhookevent (item_id) WHERE item_id IS NOT NULL"
    )


def drop(apps, schema_editor):
    concurrently = (
        " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    )
    schema_editor.execute(f"DROP INDEX{concurrently} IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("jobs", "0009_webhooks"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(create, drop, elidable=False)],
            state_operations=[
                migrations.AddIndex(
                    model_name="webhookevent",
                    index=models.Index(
                        fields=["item"],
                        name=INDEX,
                        condition=models.Q(item__isnull=False),
                    ),
                )
            ],
        )
    ]
