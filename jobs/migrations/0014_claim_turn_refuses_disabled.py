"""``recall_claim_turn(worker)`` answers -1 for a disabled worker (PostgreSQL only).

A claim authenticated just before ``disable_and_reclaim`` committed would
otherwise lease a job to the worker that was just stopped: the turn's lock is
the one ``disable_and_reclaim``'s update of the worker row takes, so reading
``is_active`` once the turn came sees every disable committed before it. The
claim statements lease nothing when the turn is -1, and the statement backend
raises ``WorkerDisabled``, as the ORM backend's ``_claim_turn`` does.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION recall_claim_turn(worker bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    active boolean;
    held bigint;
BEGIN
    SELECT is_active INTO active FROM jobs_worker WHERE id = worker
        FOR NO KEY UPDATE;
    IF active IS NOT TRUE THEN
        RETURN -1;  -- disabled (or gone): no turn
    END IF;
    -- A query of its own: a fresh snapshot, taken once the turn came.
    SELECT count(*) INTO held FROM jobs_job WHERE leased_by_id = worker;
    RETURN held;
END
$$
"""

# 0013's function, for the way back.
PREVIOUS = """
CREATE OR REPLACE FUNCTION recall_claim_turn(worker bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    held bigint;
BEGIN
    PERFORM 1 FROM jobs_worker WHERE id = worker FOR NO KEY UPDATE;
    -- A query of its own: a fresh snapshot, taken once the turn came.
    SELECT count(*) INTO held FROM jobs_job WHERE leased_by_id = worker;
    RETURN held;
END
$$
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PREVIOUS)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0013_claim_turn"),
    ]

    operations = [migrations.RunPython(create, restore, elidable=False)]
