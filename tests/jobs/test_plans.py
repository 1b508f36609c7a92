"""The statement backend's prepared statements keep one plan each (PostgreSQL).

Left to choose, PostgreSQL planned the claim anew on every call once labels
were in it (``backends/postgres.py``, ``plan_once``): these tests read the
session's own prepared statements to see how each was planned.
"""

import pytest
from django.db import connection, connections
from django.test import override_settings

from jobs import transitions
from tests.support.factories import T0, make_batch

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


@pytest.fixture(autouse=True)
def statement_backend(settings):
    """Only the statement backend prepares statements: the run of the suite
    with ``RECALL_TRANSITIONS_BACKEND=orm`` has none to plan."""
    if settings.RECALL_TRANSITIONS_BACKEND == "orm":
        pytest.skip("the ORM backend prepares no statements")


LABELS = {"gpu": "a100", "model": "large-v3"}


def plans() -> dict[str, tuple[int, int]]:
    """This session's prepared statements: text -> (generic plans, custom plans)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        )
        return {text: (generic, custom) for text, generic, custom in cursor.fetchall()}


def executions(found: dict[str, tuple[int, int]], start: str) -> int:
    return sum(g + c for text, (g, c) in found.items() if text.startswith(start))


def test_claims_and_completions_with_labels_are_never_planned_again(worker):
    open_to_all = make_batch(30, name="any")
    routed = make_batch(30, name="routed")
    transitions.set_requires(routed, {"gpu": "a100"}, now=T0)
    before = plans()

    for _ in range(30):
        job = transitions.claim_next(worker, labels=LABELS, now=T0)
        transitions.complete(job, job.lease_token, worker=worker, result={"text": "ok"})

    after = plans()
    # Both batches served in turn (fair share between equal priorities).
    assert open_to_all.counts()["done"] == routed.counts()["done"] == 15
    claims = executions(after, "WITH chores") - executions(before, "WITH chores")
    assert claims == 30
    # Every execution ran the one generic plan: none was planned with its values.
    assert {text[:40]: custom for text, (_, custom) in after.items() if custom} == {}


def test_a_new_connection_keeps_generic_plans_only_when_statements_are_prepared():
    def mode() -> str:
        fresh = connections.create_connection("default")
        try:
            with fresh.cursor() as cursor:
                cursor.execute("SHOW plan_cache_mode")
                return cursor.fetchone()[0]
        finally:
            fresh.close()

    assert mode() == "force_generic_plan"
    with override_settings(RECALL_PREPARED_STATEMENTS=False):
        assert mode() == "auto"
    with override_settings(RECALL_TRANSITIONS_BACKEND="orm"):
        assert mode() == "auto"
