"""Issue 27, items 4 to 6, as a person sees them: a silent lease painted apart
from transcribing in the batch's bar and legend, each throughput with its
window, a finished batch's ETA as "—", and the flaky flag with its rule."""

from __future__ import annotations

from datetime import timedelta

import pytest
from playwright.sync_api import Page, expect

from jobs import transitions
from tests.support.factories import claim, make_batch, make_worker

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]

AMBER = "rgb(232, 163, 23)"


def test_a_silent_lease_is_painted_apart_and_throughput_names_its_window(
    logged_in: Page, live_server, artifacts
):
    page = logged_in
    now = transitions.now()
    batch = make_batch(4, name="interviews", now=now - timedelta(minutes=5))
    worker = make_worker("gpu-1")
    claim(worker, now=now - timedelta(seconds=50))  # 60 s leases: silent after 40 s
    claim(worker, now=now)

    page.goto(f"{live_server.url}/batches/{batch.pk}/")

    expect(page.locator('[data-count="transcribing"]')).to_have_text("1")
    expect(page.locator('[data-count="silent"]')).to_have_text("1")
    silent = page.locator("#batch-live .bar .seg-silent")
    expect(silent).to_have_count(1)
    assert silent.evaluate("e => getComputedStyle(e).fill") == AMBER
    bar = page.locator("#batch-live .bar").bounding_box()
    box = silent.bounding_box()
    assert bar and box
    assert abs(box["width"] - bar["width"] / 4) <= 2  # one item of four
    assert bar["x"] <= box["x"] and box["x"] + box["width"] <= bar["x"] + bar["width"]
    expect(page.locator("[data-throughput-window]")).to_have_text("last 5 min")
    page.screenshot(path=str(artifacts / "batch-silent-lease.png"), full_page=True)

    page.goto(f"{live_server.url}/overview/")
    expect(page.locator('[data-figure="silent"]')).to_have_text("1")
    expect(page.locator(".tile", has_text="Throughput")).to_contain_text(
        "items done per minute, last 5 min"
    )


def test_a_finished_batch_shows_its_run_average_and_no_eta(
    logged_in: Page, live_server
):
    page = logged_in
    now = transitions.now()
    batch = make_batch(2, name="press", now=now - timedelta(minutes=3))
    worker = make_worker("gpu-1")
    for _ in range(2):
        job = claim(worker, now=now)
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": "t"}, now=now
        )

    page.goto(f"{live_server.url}/batches/{batch.pk}/")

    expect(page.locator("[data-eta]")).to_have_text("—")
    expect(page.locator("[data-throughput]")).to_have_text(
        "0.7 items/min average over its 3 min run"
    )


def test_the_workers_page_flags_a_flaky_worker_and_says_why(
    logged_in: Page, live_server, artifacts
):
    page = logged_in
    now = transitions.now()
    make_batch(30, now=now - timedelta(hours=1))
    flaky = make_worker("gpu-flaky")
    for minutes in (40, 25, 10):  # three crashes in the last hour
        at = now - timedelta(minutes=minutes)
        for _ in range(8):
            job = claim(flaky, now=at)
            transitions.complete(
                job, job.lease_token, worker=flaky, result={"text": "t"}, now=at
            )
        claim(flaky, now=at)
        transitions.reclaim_expired(now=at + timedelta(minutes=2))

    page.goto(f"{live_server.url}/workers/")

    row = page.locator("tr", has_text="gpu-flaky")
    expect(row.locator(".state-failed")).to_have_text("flaky")
    expect(row.locator("[data-incidents]")).to_have_text("3 times in the last hour")
    expect(page.locator("[data-flaky-rule]")).to_contain_text(
        "leases ran out at 3 or more separate times in the last hour"
    )
    page.screenshot(path=str(artifacts / "workers-flaky.png"), full_page=True)
