"""Operator pages: lists and filters, live fragments, progress.json, item detail,
workers, and the query counts that keep them fast."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from batches.models import Batch
from jobs import transitions
from jobs.models import Job
from tests.support.factories import claim, make_batch, make_worker

pytestmark = pytest.mark.django_db


def _finish(worker, n, fail=False):
    # A worker's API calls record that it was seen (routing, issue 26: a batch
    # no worker online can take waits, without an ETA); the transitions alone
    # do not, so the helper does.
    transitions.touch_worker(worker, now=timezone.now())
    for _ in range(n):
        job = claim(worker, now=timezone.now())
        if fail:
            transitions.fail(
                job, job.lease_token, worker=worker, error="bad audio", retryable=False
            )
        else:
            transitions.complete(
                job,
                job.lease_token,
                worker=worker,
                result={
                    "text": "hi",
                    "segments": [{"start": 0, "end": 1, "text": "hi"}],
                },
            )


def _names(response) -> list[str]:
    return re.findall(r'<a href="/batches/\d+/">([^<]+)</a>', response.content.decode())


@pytest.fixture
def batches(worker):
    finished = make_batch(1, name="finished one")
    _finish(worker, 1)
    running = make_batch(3, name="running one")
    claim(worker, now=timezone.now())
    paused = make_batch(2, name="paused one")
    transitions.pause_batch(paused)
    cancelled = make_batch(2, name="cancelled one")
    transitions.cancel_batch(cancelled)
    return {
        "running": running,
        "finished": finished,
        "paused": paused,
        "cancelled": cancelled,
    }


def test_batches_list_shows_every_batch_with_its_state(viewer_client, batches):
    response = viewer_client.get("/")

    assert response.status_code == 200
    assert _names(response) == [
        "cancelled one",
        "paused one",
        "running one",
        "finished one",
    ]
    page = response.content.decode()
    for state in ("running", "finished", "paused", "cancelled"):
        assert f'class="state state-{state}">{state}</span>' in page


@pytest.mark.parametrize("state", ["running", "finished", "paused", "cancelled"])
def test_batches_list_filters_by_state(state, viewer_client, batches):
    assert _names(viewer_client.get(f"/?state={state}")) == [f"{state} one"]


def test_batches_list_filters_stalled(viewer_client, batches, settings):
    settings.RECALL_STALLED_AFTER_SECONDS = 60
    Job.objects.filter(status="leased").update(
        heartbeat_at=timezone.now() - timedelta(minutes=5)
    )

    assert _names(viewer_client.get("/?state=stalled")) == ["running one"]
    assert _names(viewer_client.get("/?state=running")) == []


def test_batches_list_searches_names_and_paginates(viewer_client, db):
    for i in range(30):
        make_batch(1, name=f"calls {i:02d}")
    make_batch(1, name="podcast")

    assert _names(viewer_client.get("/?q=PODCAST")) == ["podcast"]
    first = viewer_client.get("/?q=calls")
    assert len(_names(first)) == 25
    assert "Page 1 of 2 · 30 in all" in first.content.decode()
    assert _names(viewer_client.get("/?q=calls&page=2")) == [
        f"calls {i:02d}" for i in range(4, -1, -1)
    ]


def test_batch_detail_shows_counts_eta_basis_and_chart(viewer_client, worker):
    batch = make_batch(10)
    _finish(worker, 4)
    _finish(worker, 1, fail=True)

    page = viewer_client.get(f"/batches/{batch.pk}/").content.decode()

    assert '<strong data-count="done">4</strong>' in page
    assert '<strong data-count="failed">1</strong>' in page
    assert '<strong data-count="queued">5</strong>' in page
    assert "40.0% done" in page
    assert '<progress max="10" value="4"' in page
    assert "How the ETA is computed" in page
    assert "5 items left, at" in page
    assert "Items done per minute, last hour: 4 in all" in page
    assert page.count("<rect ") == 60


def test_items_table_filters_and_counts_from_the_counters(viewer_client, worker):
    batch = make_batch(120)
    _finish(worker, 3, fail=True)

    failed = viewer_client.get(
        f"/batches/{batch.pk}/items/live?state=failed"
    ).content.decode()
    assert failed.count('class="state state-failed"') == 3
    queued = viewer_client.get(
        f"/batches/{batch.pk}/items/live?state=queued&last=1"
    ).content.decode()
    assert "· 117 in all" in queued
    assert queued.count('class="state state-queued"') == 50
    assert "Next →" not in queued and "← Previous" in queued
    search = viewer_client.get(f"/batches/{batch.pk}/?q=batch-11").content.decode()
    assert sorted(set(re.findall(r"/audio/(batch-11\d*)\.wav", search))) == [
        "batch-11"
    ] + [f"batch-11{i}" for i in range(10)]
    assert "Search results do not refresh by themselves" in search


def test_a_bad_filter_is_reported_not_a_500(viewer_client, batch):
    response = viewer_client.get(f"/batches/{batch.pk}/?state=exploded&q=%00")

    assert response.status_code == 200
    assert "Select a valid choice" in response.content.decode()


def test_live_fragments_are_marked_and_stop_when_final(viewer_client, worker):
    batch = make_batch(1)
    live = viewer_client.get(f"/batches/{batch.pk}/live")
    assert (live.status_code, live["X-Recall-Fragment"]) == (200, "1")
    assert live.content.decode().lstrip().startswith('<section id="batch-live"')

    _finish(worker, 1)

    final = viewer_client.get(f"/batches/{batch.pk}/live")
    assert final.status_code == 286
    assert 'data-live-final="1"' in final.content.decode()
    assert viewer_client.get(f"/batches/{batch.pk}/items/live").status_code == 286
    assert viewer_client.get("/batches/live").status_code == 286


def test_progress_json(viewer_client, worker):
    batch = make_batch(4)
    _finish(worker, 1)
    claim(worker, now=timezone.now())

    response = viewer_client.get(f"/batches/{batch.pk}/progress.json")

    body = response.json()
    assert set(body) == {
        "batch",
        "state",
        "total",
        "counts",
        "percent_done",
        "throughput_per_minute",
        "eta_seconds",
        # Added by fair share (issue 12); the fields above keep their meaning.
        "weight",
        "max_in_flight",
        "in_flight",
        # Added by silent leases and retry waits (issue 27).
        "silent",
        "retry",
        # Added by routing (issue 26).
        "requires",
        "waiting_for_worker",
    }
    assert (body["batch"], body["state"], body["total"], body["percent_done"]) == (
        batch.pk,
        "running",
        4,
        25.0,
    )
    assert body["counts"] == {
        "queued": 2,
        "transcribing": 1,
        "done": 1,
        "failed": 0,
        "cancelled": 0,
    }
    assert body["throughput_per_minute"] > 0
    assert isinstance(body["eta_seconds"], int) and body["eta_seconds"] >= 0
    assert response["Cache-Control"] == "no-store"


def test_progress_json_eta_is_null_when_unknown(viewer_client, batch):
    body = viewer_client.get(f"/batches/{batch.pk}/progress.json").json()

    assert (body["eta_seconds"], body["throughput_per_minute"]) == (None, 0.0)


def test_item_detail_shows_lease_attempts_and_repairs(viewer_client, worker):
    batch = make_batch(1)
    job = claim(worker, now=timezone.now())
    transitions.fail(
        job, job.lease_token, worker=worker, error="decoder crashed", retryable=True
    )
    Job.objects.filter(pk=job.pk).update(available_at=timezone.now())
    job = claim(make_worker("gpu-9"), now=timezone.now())
    Batch.objects.filter(pk=batch.pk).update()
    from batches.models import BatchItem

    BatchItem.objects.filter(pk=job.item_id).update(status="queued")
    from engine.reconcile import reconcile

    reconcile(now=timezone.now())

    page = viewer_client.get(f"/items/{job.item_id}/").content.decode()

    assert "decoder crashed" in page
    assert '<span class="reason reason-failed">failed</span>' in page
    assert "gpu-9" in page and "gpu-1" in page
    assert "data-countdown" in page
    assert "Item was queued while its job was leased; set to transcribing." in page


def test_item_detail_shows_the_transcript(viewer_client, worker):
    make_batch(1)
    job = claim(worker, now=timezone.now())
    transitions.complete(
        job,
        job.lease_token,
        worker=worker,
        result={
            "text": "the quick brown fox",
            "language": "en",
            "segments": [{"start": 0, "end": 1, "text": "x"}],
        },
    )

    page = viewer_client.get(f"/items/{job.item_id}/").content.decode()

    assert "the quick brown fox" in page
    assert "Language en · 1 timed segment" in page


def test_workers_page_counts_and_flags_flaky_workers(viewer_client, db):
    make_batch(10)
    steady, flaky = make_worker("steady"), make_worker("flaky-box")
    _finish(steady, 2)
    for _ in range(3):
        claim(flaky, now=timezone.now() - timedelta(hours=1))
        transitions.reclaim_expired(now=timezone.now())
    claim(steady, now=timezone.now())

    page = viewer_client.get("/workers/").content.decode()

    rows = dict(re.findall(r'<th scope="row">([\w-]+)(.*?)</tr>', page, re.S))
    assert "flaky</span>" in rows["flaky-box"]
    assert "flaky</span>" not in rows["steady"]
    assert re.findall(r'<td class="num">(\d+)', rows["steady"]) == ["2", "0", "0"]
    assert re.findall(r'<td class="num">(\d+)', rows["flaky-box"]) == ["0", "0", "3"]
    assert "expires in" in rows["steady"]


def test_pages_take_a_fixed_number_of_queries(
    viewer_client, worker, django_assert_max_num_queries, settings
):
    settings.RECALL_MAX_LEASES_PER_WORKER = 1_000  # one worker stands for a fleet
    small = make_batch(5, name="small")
    big = make_batch(600, name="big")
    for _ in range(40):
        claim(worker, now=timezone.now())
    _finish(worker, 20)

    # 17: one for the labels of the workers online (issue 26).
    for batch in (small, big):
        with django_assert_max_num_queries(17):
            viewer_client.get(f"/batches/{batch.pk}/")
    with django_assert_max_num_queries(17):
        viewer_client.get("/")
    with django_assert_max_num_queries(12):
        viewer_client.get("/workers/")


def test_items_pages_by_keyset_forward_and_back(viewer_client):
    batch = make_batch(120)
    ids = list(batch.items.order_by("pk").values_list("pk", flat=True))

    def shown(query):
        page = viewer_client.get(
            f"/batches/{batch.pk}/items/live?{query}"
        ).content.decode()
        return [
            int(i)
            for i in re.findall(r'<td class="num"><a href="/items/(\d+)/">', page)
        ], page

    first, page = shown("")
    assert first == ids[:50]
    assert "« First" not in page and f"after={ids[49]}" in page
    second, page = shown(f"after={ids[49]}")
    assert second == ids[50:100]
    assert f"before={ids[50]}" in page
    third, page = shown(f"after={ids[99]}")
    assert third == ids[100:]
    assert "Next →" not in page
    back, _ = shown(f"before={ids[100]}")
    assert back == ids[50:100]
    last, _ = shown("last=1")
    assert last == ids[70:]
    bad, _ = shown("after=abc&before=99999999999999999999999")
    assert bad == ids[:50]
