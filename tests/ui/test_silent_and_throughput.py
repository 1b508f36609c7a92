"""Silent leases and throughput windows on the pages and in progress.json
(issue 27, items 4 and 5); the rules are tested in tests/batches."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Job
from tests.support.factories import claim, make_batch


@pytest.mark.django_db
def test_pages_and_progress_json_show_silent_leases_apart(viewer_client, worker):
    batch = make_batch(4)
    now = timezone.now()
    claim(worker, now=now - timedelta(seconds=50))  # 60 s leases: silent after 40 s
    claim(worker, now=now)

    body = viewer_client.get(f"/batches/{batch.pk}/progress.json").json()
    page = viewer_client.get(f"/batches/{batch.pk}/").content.decode()
    overview = viewer_client.get("/overview/").content.decode()

    assert (body["in_flight"], body["silent"]) == (2, 1)
    assert body["counts"]["transcribing"] == 2
    shown = dict(re.findall(r'data-count="(\w+)">(\d+)<', page))
    assert (shown["transcribing"], shown["silent"]) == ("1", "1")
    assert 'data-figure="silent">1<' in overview
    assert "silent, no heartbeat for 40 s" in overview
    shown = dict(re.findall(r'data-count="(\w+)">(\d+)<', overview))
    assert (shown["transcribing"], shown["silent"]) == ("1", "1")
    assert Job.objects.filter(status="leased").count() == 2
    assert "last " in page and "items/min" in page
