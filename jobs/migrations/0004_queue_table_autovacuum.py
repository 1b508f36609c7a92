"""Autovacuum settings of their own for the tables every claim and completion
updates (PostgreSQL only).

A claim and a completion rewrite a job, its item, a counter shard, a ledger row
and a throughput minute; with the default thresholds (20% of a table dead before
a vacuum) a table of a million finished jobs piles up 200,000 dead rows between
vacuums, and the claim's index scans wade through them. These make autovacuum
visit the hot tables after about 1% of churn, and the tiny counter tables after
a fixed number of updates, and keep statistics fresh for the claim's plans.
"""

from django.db import migrations

SETTINGS = {
    "jobs_job": "autovacuum_vacuum_scale_factor = 0.01, "
    "autovacuum_vacuum_threshold = 1000, "
    "autovacuum_analyze_scale_factor = 0.01, "
    "autovacuum_analyze_threshold = 1000, "
    "autovacuum_vacuum_cost_delay = 1",
    "jobs_lease": "autovacuum_vacuum_scale_factor = 0.02, "
    "autovacuum_analyze_scale_factor = 0.02, "
    "autovacuum_vacuum_cost_delay = 1",
    "batches_batchitem": "autovacuum_vacuum_scale_factor = 0.01, "
    "autovacuum_vacuum_threshold = 1000, "
    "autovacuum_analyze_scale_factor = 0.02, "
    "autovacuum_vacuum_cost_delay = 1",
    "batches_batchcounter": "autovacuum_vacuum_scale_factor = 0, "
    "autovacuum_vacuum_threshold = 2000",
    "batches_batchminute": "autovacuum_vacuum_scale_factor = 0, "
    "autovacuum_vacuum_threshold = 2000",
}


def set_autovacuum(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, settings in SETTINGS.items():
        schema_editor.execute(f"ALTER TABLE {table} SET ({settings})")


def reset_autovacuum(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, settings in SETTINGS.items():
        names = ", ".join(part.split("=")[0].strip() for part in settings.split(","))
        schema_editor.execute(f"ALTER TABLE {table} RESET ({names})")


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0003_worker_permissions"),
        ("batches", "0003_operator_groups"),
    ]

    operations = [migrations.RunPython(set_autovacuum, reset_autovacuum)]
