"""The overview in a real browser: a login lands on it, its figures change
without a reload while a worker works, it pauses on a hidden tab like the batch
pages, and its screenshot is kept in test-artifacts/."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from engine.manifests import create_batch
from engine.sweep import sweep
from jobs import transitions
from jobs.models import Worker
from tests.support.browser import Api
from tests.support.factories import make_worker

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


def _a_fleet_at_work() -> None:
    """An hour of history: two batches, steady completions, a worker whose
    leases keep expiring, a paused batch, a recent sweep."""
    now = timezone.now()
    start = now - timedelta(minutes=58)
    lines = ["source,duration_seconds\n"] + [
        f"s3://field/interview-{i:03d}.wav,{60 + i % 90}\n" for i in range(300)
    ]
    create_batch("Field interviews", lambda: iter(lines), now=start)
    press = [f"s3://press/call-{i:02d}.wav\n" for i in range(12)]
    transitions.pause_batch(
        create_batch("Press calls", lambda: iter(press), priority=-1, now=start),
        now=start,
    )
    steady, flaky = make_worker("gpu-steady"), make_worker("gpu-flaky")
    for minute in range(57):
        at = start + timedelta(minutes=minute, seconds=30)
        if minute % 15 == 3:  # the flaky box takes a job and dies
            transitions.claim_next(flaky, now=at)
            sweep(now=at + timedelta(minutes=2))
        for _ in range(1 + minute % 4):
            job = transitions.claim_next(steady, now=at)
            transitions.complete(
                job, job.lease_token, worker=steady, result={"text": "…"}, now=at
            )
    sweep(now=now - timedelta(seconds=20))
    Worker.objects.filter(pk=steady.pk).update(last_seen=now)


def test_the_overview_follows_the_fleet_without_a_reload(
    logged_in: Page, live_server, artifacts
):
    page = logged_in
    _a_fleet_at_work()
    page.reload()
    page.evaluate("window.__marker = 'same page'")
    in_flight = page.locator('[data-figure="in-flight"]')
    expect(in_flight).to_have_text("0")
    expect(page.locator("[data-flaky]")).to_contain_text("gpu-flaky (4 of 4")
    api = Api(live_server.url, "gpu-browser")

    status, body = api.claim()

    assert status == 200
    expect(in_flight).to_have_text("1", timeout=10_000)
    expect(page.locator('[data-figure="busy"]')).to_have_text("1")
    page.screenshot(path=str(artifacts / "overview.png"), full_page=True)
    done_before = int(page.locator('[data-count="done"]').inner_text())
    api.complete(body["job"])
    expect(in_flight).to_have_text("0", timeout=10_000)
    expect(page.locator('[data-count="done"]')).to_have_text(str(done_before + 1))
    assert page.evaluate("window.__marker") == "same page"  # never reloaded


def test_the_overview_pauses_while_the_tab_is_hidden(logged_in: Page):
    page = logged_in
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url) if "/live" in r.url else None)
    with page.expect_request(
        lambda r: r.url.endswith("/overview/live"), timeout=10_000
    ):
        pass

    page.evaluate(
        """() => {
            Object.defineProperty(document, "visibilityState", {configurable: true, get: () => "hidden"});
            document.dispatchEvent(new Event("visibilitychange"));
        }"""
    )
    expect(page.locator("[data-refresh-status]")).to_have_text("paused while hidden")
    page.wait_for_timeout(300)  # a fetch already in flight may still land
    before = len(requests)
    page.wait_for_timeout(4_000)  # two intervals: nothing may be fetched
    assert len(requests) == before
