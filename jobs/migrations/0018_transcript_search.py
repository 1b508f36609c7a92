"""The full-text index over completed jobs' transcripts (PostgreSQL only).

An expression index, not a column: ``to_tsvector('simple', ...)`` of the first
100,000 characters of ``result->>'text'``, over the completed jobs only. No
transition writes it: the completion that stores a result indexes it in its
own transaction, and a job that leaves ``completed`` (or is purged) leaves the
index with it. ``jobs.search`` writes the same expression in its queries; the
``simple`` configuration assumes no language (``jobs/search.py``).

Not in ``Job.Meta.indexes``: SQLite has no such index (its search is a scan).
Built ``CONCURRENTLY`` so that a big jobs table is not locked against claims
and completions meanwhile.
"""

from django.db import migrations

INDEX = "job_transcript_search"
VECTOR = (
    "to_tsvector('simple'::regconfig, left(COALESCE((result ->> 'text'), ''), 100000))"
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {INDEX} "
        f"ON jobs_job USING gin ({VECTOR}) WHERE status = 'completed'"
    )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("jobs", "0017_rerun_job_requires_and_runs"),
    ]

    operations = [migrations.RunPython(create, drop, elidable=False)]
