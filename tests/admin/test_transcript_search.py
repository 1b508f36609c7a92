"""The admin's item and job lists find rows by the words of their transcripts
too (issue 29), with the batch page's search (``jobs.search``): full-text on
PostgreSQL (whole words, any case), substrings on SQLite; the sources' match,
ids and lease tokens work as before."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs import transitions
from jobs.models import Job
from jobs.search import transcript_vector_sql
from tests.support.admin import JOBS, act, messages_of
from tests.support.factories import is_postgres, make_batch

pytestmark = pytest.mark.django_db

ITEMS = "/admin/batches/batchitem/"
# The index's expression (jobs.search.transcript_vector_sql) over a job's result,
# whatever the query calls the jobs table.
INDEXED_MATCH = re.escape(transcript_vector_sql("RESULT")).replace(
    "RESULT", r"[\w\"]+\.\"result\""
) + re.escape(" @@ plainto_tsquery('simple'::regconfig, 'refund')")
TRANSCRIPTS = {
    "file:///audio/calls-0.wav": "The customer asked for a refund today",
    "file:///audio/calls-1.wav": "Nothing to see here",
    "file:///audio/calls-2.wav": "A refund, said the earlier run",
    "file:///audio/refunds-0.wav": "Hello there",
    "file:///audio/refunds-1.wav": "",
    "file:///audio/talks-0.wav": "A refund was issued",
}


@pytest.fixture
def transcribed(worker) -> dict[str, Job]:
    """Three batches, every job completed with its TRANSCRIPTS entry; then
    calls-2 re-run (queued again: its transcript is an earlier run's)."""
    batches = [make_batch(3, name="calls"), make_batch(2, name="refunds")]
    batches.append(make_batch(1, name="talks"))
    while (job := transitions.claim_next(worker)) is not None:
        text = TRANSCRIPTS[job.item.source]
        transitions.complete(job, job.lease_token, worker=worker, result={"text": text})
    jobs = {
        job.item.source.rsplit("/", 1)[1].removesuffix(".wav"): job
        for job in Job.objects.select_related("item")
    }
    assert transitions.rerun(batches[0], items=[jobs["calls-2"].item_id]) == 1
    return jobs


def _listed(client, url: str) -> list[int]:
    response = client.get(url)
    assert response.status_code == 200, response.content
    return sorted(row.pk for row in response.context["cl"].result_list)


def _items(jobs: dict[str, Job], *names: str) -> list[int]:
    return sorted(jobs[name].item_id for name in names)


def _jobs(jobs: dict[str, Job], *names: str) -> list[int]:
    return sorted(jobs[name].pk for name in names)


def test_the_item_list_finds_items_by_transcript_words_and_source(
    superuser_client, transcribed
):
    jobs = transcribed
    found = {
        # Transcripts (calls-2's was its earlier run: not found) and sources.
        "refund": _items(jobs, "calls-0", "talks-0", "refunds-0", "refunds-1"),
        # Every word, in any order and case.
        "today+REFUND": _items(jobs, "calls-0"),
        "customer+refund+nobody": [],
        # The sources as before: a substring, case matters.
        "calls-1.wav": _items(jobs, "calls-1"),
        "--": [],  # no word: the sources alone
        str(jobs["talks-0"].item_id): _items(jobs, "talks-0"),  # an id
    }
    for q, expected in found.items():
        assert _listed(superuser_client, f"{ITEMS}?q={q}") == expected, q
    calls = jobs["calls-0"].batch_id
    assert _listed(superuser_client, f"{ITEMS}?q=refund&batch__id__exact={calls}") == (
        _items(jobs, "calls-0")
    )
    assert _listed(superuser_client, f"{ITEMS}?q=refund&status__exact=done") == (
        _items(jobs, "calls-0", "talks-0", "refunds-0", "refunds-1")
    )
    assert _listed(superuser_client, f"{ITEMS}?q=refund&status__exact=queued") == ([])
    # Whole words on PostgreSQL; substrings on SQLite ("fund" in "refund").
    fund = ["refunds-0", "refunds-1"]
    if not is_postgres():
        fund += ["calls-0", "talks-0"]
    assert _listed(superuser_client, f"{ITEMS}?q=fund") == _items(jobs, *fund)


def test_the_job_list_finds_jobs_by_transcript_words_and_source(
    superuser_client, transcribed
):
    jobs = transcribed
    found = {
        "refund": _jobs(jobs, "calls-0", "talks-0", "refunds-0", "refunds-1"),
        "today+REFUND": _jobs(jobs, "calls-0"),
        "hello": _jobs(jobs, "refunds-0"),
        "talks-0.wav": _jobs(jobs, "talks-0"),
        str(jobs["calls-1"].pk): _jobs(jobs, "calls-1"),
    }
    for q, expected in found.items():
        assert _listed(superuser_client, f"{JOBS}?q={q}") == expected, q
    assert _listed(superuser_client, f"{JOBS}?q=refund&status__exact=queued") == []


@pytest.mark.postgres
def test_on_postgresql_the_transcripts_are_searched_through_the_index(
    superuser_client, transcribed
):
    """The list's queries match transcripts with the indexed expression and
    the sources apart from them (a union, not an OR over both tables)."""
    assert is_postgres()
    with CaptureQueriesContext(connection) as queries:
        assert len(_listed(superuser_client, f"{ITEMS}?q=refund")) == 4
    searches = [q["sql"] for q in queries if "plainto_tsquery" in q["sql"]]

    assert len(searches) == 2  # the count and the page
    for sql in searches:
        assert "UNION" in sql
        assert re.search(INDEXED_MATCH, sql), sql
        assert " OR " not in sql


def test_the_re_run_action_takes_every_item_a_transcript_search_lists(
    superuser_client, transcribed
):
    """Every item a transcript search lists ("all N matching"), re-run from
    the item list: the action filters the search's rows as any list's."""
    jobs = transcribed

    response = act(
        superuser_client,
        "rerun_items",
        [jobs["calls-0"].item_id],
        confirm=False,
        url=f"{ITEMS}?q=today+refund",
        select_across=True,
    )

    assert response.status_code == 302
    assert messages_of(response) == ["Re-running 1 item as a new run."]
    assert sorted(
        Job.objects.filter(status="queued").values_list("item_id", flat=True)
    ) == _items(jobs, "calls-0", "calls-2")
