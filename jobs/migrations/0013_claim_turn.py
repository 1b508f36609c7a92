"""``recall_claim_turn(worker)``: a worker's turn to claim, and its live leases
counted after the turn came (PostgreSQL only).

The lease cap (``RECALL_MAX_LEASES_PER_WORKER``) is enforced by the claim
itself. The PostgreSQL statement backend claims in one statement, and under
READ COMMITTED a statement reads one snapshot, taken when it starts: a count
read in the statement that waited for the worker's lock would miss the claims
committed while it waited, and 16 simultaneous claims of one worker with a cap
of 2 leased 8. A VOLATILE function takes a new snapshot for each query it runs,
so this one locks the worker's row (claims of one worker take turns until
their transaction ends, as the ORM backend's ``_claim_turn`` does with
``select_for_update``) and only then counts the worker's jobs: every claim that
held the turn before has committed, and is counted.
"""

from django.db import migrations

CREATE = """
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
DROP = "DROP FUNCTION IF EXISTS recall_claim_turn(bigint)"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0012_stored_json_decoder"),
    ]

    operations = [migrations.RunPython(create, drop, elidable=False)]
