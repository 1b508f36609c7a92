"""An index on the lease ledger's abnormal endings, for the overview page.

The overview counts leases that ended ``expired`` or ``forced`` in the last hour
and day, and finds the workers whose leases keep expiring. Without an index
that is a scan of the whole ledger (a row per attempt: millions) on every
refresh. Such endings are rare, so a partial index over them stays small, and
completions (the common ending) never write to it.

Declared in ``Lease.Meta.indexes``; built here by hand so that on PostgreSQL it
is built ``CONCURRENTLY``, and a big ledger is not locked against writes
meanwhile.
"""

from django.db import migrations, models

INDEX = "lease_abnormal_end"


def create(apps, schema_editor):
    concurrently = (
        " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    )
    schema_editor.execute(
        f"CREATE INDEX{concurrently} IF NOT EXISTS {INDEX} "
        f"ON jobs_lease (end_reason, ended_at) "
        f"WHERE end_reason IN ('expired', 'forced')"
    )


def drop(apps, schema_editor):
    concurrently = (
        " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    )
    schema_editor.execute(f"DROP INDEX{concurrently} IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("jobs", "0007_batch_changed_event"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(create, drop, elidable=False)],
            state_operations=[
                migrations.AddIndex(
                    model_name="lease",
                    index=models.Index(
                        fields=["end_reason", "ended_at"],
                        name=INDEX,
                        condition=models.Q(end_reason__in=["expired", "forced"]),
                    ),
                )
            ],
        )
    ]
