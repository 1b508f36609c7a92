"""Every operator page as a person sees it, at 1400x900 and at 390x844 (issue 27).

No page is wider than the viewport; every bar segment is painted in its
state's colour (read from a screenshot at the segment's position) and as wide
as its count; the admin's list shows its bar, done, throughput and ETA on
screen; the workers page refreshes; the batch page has one bar and labelled
chart axes. A screenshot of every page at both sizes is kept under
var/screenshots/ (look at them).
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import Browser, Locator, Page, expect

from batches.models import Batch, BatchItem
from engine.manifests import create_batch
from jobs import transitions
from jobs.models import Job, Worker
from tests.support.factories import make_user, make_worker
from tests.support.pixels import close, decode, hex_rgb

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]

SCREENSHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
DESKTOP = {"width": 1400, "height": 900}
PHONE = {"width": 390, "height": 844}

# The colours the bars are painted in (light theme): the operator pages'
# (static/css/recall.css) and the admin's own (its base.css variables).
UI = {
    "done": "#1e8e3e",
    "failed": "#c5221f",
    "transcribing": "#1a73e8",
    "silent": "#e8a317",
    "queued": "#9aa0a6",
    "cancelled": "#a0522d",
}
ADMIN = {
    "done": "#1e8e3e",
    "failed": "#ba2121",
    "transcribing": "#417893",
    "silent": "#e8a317",
    "queued": "#666666",
    "cancelled": "#a0522d",
}
LONG = "s3://field-recordings-2026/regional-office/households/second-visit/"


def _an_afternoon() -> dict:
    """A running batch with items in every state and long sources, a done item
    whose first attempt failed, a finished batch, two workers."""
    now = timezone.now()
    start = now - timedelta(minutes=40)
    lines = [f"{LONG}interview-{i:04d}.wav\n" for i in range(40)]
    batch = create_batch("Field interviews", lambda: iter(lines), now=start)
    press = [f"s3://press/call-{i:02d}.wav\n" for i in range(4)]
    finished = create_batch("Press calls", lambda: iter(press), priority=5, now=start)
    steady, flaky = make_worker("gpu-steady"), make_worker("gpu-flaky")
    for minute in range(4):  # the press calls, one a minute
        at = start + timedelta(minutes=minute + 1)
        job = transitions.claim_next(steady, now=at)
        transitions.complete(
            job, job.lease_token, worker=steady, result={"text": "…"}, now=at
        )
    retried = transitions.claim_next(steady, now=start + timedelta(minutes=6))
    transitions.fail(
        retried,
        retried.lease_token,
        worker=steady,
        error="CUDA out of memory on the first try",
        now=start + timedelta(minutes=6),
    )
    for minute in range(7, 19):  # done, in bursts
        at = start + timedelta(minutes=minute)
        job = transitions.claim_next(steady, now=at)
        if minute % 6 == 0:
            transitions.fail(
                job,
                job.lease_token,
                worker=steady,
                error="unreadable audio",
                retryable=False,
                now=at,
            )
        else:
            transitions.complete(
                job, job.lease_token, worker=steady, result={"text": "…"}, now=at
            )
    for _ in range(3):  # in flight now
        transitions.claim_next(flaky, now=now)
    Worker.objects.filter(pk=steady.pk).update(last_seen=now)
    return {
        "batch": batch,
        "finished": finished,
        "retried": BatchItem.objects.get(job__pk=retried.pk),
        "flaky": flaky,
    }


def _counts(batch: Batch) -> dict[str, int]:
    """The batch's items by state, in the bar's order. No lease is silent: the
    seeded ones heartbeat as they are claimed, seconds before the test looks."""
    items = BatchItem.objects.filter(batch=batch)
    return {s: 0 if s == "silent" else items.filter(status=s).count() for s in UI}


@pytest.fixture
def open_page(browser: Browser, live_server):
    """Opens a page at a window size, logged in to the operator pages or the
    admin (as a superuser), or not at all; every context is closed after the
    test, failed or not, so no page keeps refreshing into the next one."""
    opened = []

    def open_(viewport: dict, login: str | None = "ui") -> Page:
        context = browser.new_context(viewport=viewport)
        opened.append(context)
        page = context.new_page()
        if login is None:
            return page
        make_user("root", superuser=True)
        page.goto(
            live_server.url
            + ("/admin/login/" if login == "admin" else "/accounts/login/")
        )
        page.get_by_label("Username").fill("root")
        page.get_by_label("Password").fill("pw")
        page.get_by_role("button", name="Log in").click()
        page.wait_for_load_state()
        return page

    yield open_
    for context in opened:
        context.close()


def _fits(page: Page) -> None:
    scroll, inner = page.evaluate(
        "[document.documentElement.scrollWidth, window.innerWidth]"
    )
    assert scroll <= inner, f"{page.url}: {scroll} px wide in a {inner} px window"


def _shot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    width = page.viewport_size["width"]
    page.screenshot(path=str(SCREENSHOTS / f"{name}-{width}.png"), full_page=True)


def assert_bar_painted(
    page: Page, bar: Locator, counts: dict[str, int], palette: dict[str, str]
) -> None:
    """Each state with items has one segment, painted in its colour (the pixel
    at its middle, from a screenshot) and as wide as its share of the bar; the
    segments follow each other from the bar's left edge."""
    bar.scroll_into_view_if_needed()
    total = sum(counts.values())
    box = bar.bounding_box()
    shot = decode(page.screenshot(clip=box))
    inner = bar.evaluate("el => [el.clientLeft, el.clientWidth]")
    left, width = box["x"] + inner[0], inner[1]
    x = left
    for status in UI:
        segment = bar.locator(f".seg-{status}")
        if not counts[status]:
            expect(segment).to_have_count(0)
            continue
        seg = segment.bounding_box()
        assert abs(seg["x"] - x) <= 1, (status, seg, x)
        assert abs(seg["width"] - width * counts[status] / total) <= 1.5, status
        middle = (seg["x"] + seg["width"] / 2 - box["x"], box["height"] / 2)
        painted = shot.at(*middle)
        assert close(painted, hex_rgb(palette[status])), (status, painted)
        x = seg["x"] + seg["width"]
    assert abs(x - (left + width)) <= 1


# --- Every page, both sizes -----------------------------------------------------


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1400x900", "390x844"])
def test_no_page_is_wider_than_the_window(open_page, live_server, viewport):
    seeded = _an_afternoon()
    batch, item = seeded["batch"], seeded["retried"]
    job = Job.objects.filter(batch=batch, status="leased").first()
    page = open_page(viewport, login=None)
    page.goto(live_server.url + "/accounts/login/")
    _fits(page)
    _shot(page, "login")

    page = open_page(viewport)
    pages = {
        "overview": "/overview/",
        "batches": "/",
        "batch": f"/batches/{batch.pk}/",
        "item": f"/items/{item.pk}/",
        "new-batch": "/batches/new/",
        "workers": "/workers/",
        "api-tokens": "/api-tokens/",
        "admin-batches": "/admin/batches/batch/",
        "admin-batch": f"/admin/batches/batch/{batch.pk}/change/",
        "admin-job": f"/admin/jobs/job/{job.pk}/change/",
    }
    for name, path in pages.items():
        page.goto(live_server.url + path)
        page.wait_for_load_state()
        _fits(page)
        _shot(page, name)


# --- 1. The admin's batch list --------------------------------------------------


def test_the_admins_list_paints_its_bars_with_eta_on_screen(open_page, live_server):
    seeded = _an_afternoon()
    batch = seeded["batch"]
    page = open_page(DESKTOP, login="admin")
    page.goto(live_server.url + "/admin/batches/batch/")
    row = page.locator("#result_list tbody tr", has_text="Field interviews")
    expect(row.locator('[data-count="transcribing"]')).to_have_text("3")
    assert_bar_painted(page, row.locator("svg.bar"), _counts(batch), ADMIN)

    # Done, throughput and ETA are on screen beside it, without scrolling.
    for column in ("done_percent", "throughput", "eta"):
        header = page.locator(f"#result_list thead .column-{column}")
        cell = row.locator(f".field-{column}")
        for box in (header.bounding_box(), cell.bounding_box()):
            assert box["x"] + box["width"] <= DESKTOP["width"], column
            assert box["y"] + box["height"] <= DESKTOP["height"], column
    assert page.evaluate("document.querySelector('.results').scrollLeft") == 0
    bar = row.locator("svg.bar").bounding_box()
    assert 150 <= bar["width"] <= 200  # a column, not the row

    # Live: a worker finishes one, and the bar is painted again, in place.
    page.evaluate("window.__marker = 'same page'")
    flaky = Worker.objects.get(pk=seeded["flaky"].pk)
    leased = Job.objects.filter(batch=batch, status="leased").first()
    transitions.complete(
        leased, leased.lease_token, worker=flaky, result={"text": "live"}
    )
    expect(row.locator('[data-count="transcribing"]')).to_have_text("2", timeout=10_000)
    assert_bar_painted(page, row.locator("svg.bar"), _counts(batch), ADMIN)
    assert page.evaluate("window.__marker") == "same page"


# --- 2. The overview's "All items" bar ------------------------------------------


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1400x900", "390x844"])
def test_the_overviews_all_items_bar_is_drawn(open_page, live_server, viewport):
    seeded = _an_afternoon()
    page = open_page(viewport)
    page.goto(live_server.url + "/overview/")
    everything = {
        s: a + b
        for (s, a), b in zip(
            _counts(seeded["batch"]).items(),
            _counts(seeded["finished"]).values(),
            strict=True,
        )
    }
    bar = page.locator("#overview-live .summary svg.bar")
    expect(bar).to_have_attribute(
        "aria-label",
        "done 14, failed 2, transcribing 3, queued 25, cancelled 0 of 44",
    )
    assert everything == {
        "done": 14,
        "failed": 2,
        "transcribing": 3,
        "silent": 0,
        "queued": 25,
        "cancelled": 0,
    }
    assert_bar_painted(page, bar, everything, UI)


# --- 3. Phones --------------------------------------------------------------------


def test_on_a_phone_tables_stack_sources_shorten_and_the_nav_is_one_line(
    open_page, live_server
):
    seeded = _an_afternoon()
    batch = seeded["batch"]
    page = open_page(PHONE)

    # The header is one line: brand, refresh, Menu; the menu opens the links.
    page.goto(live_server.url + "/")
    header = page.locator("header.site").bounding_box()
    assert header["height"] <= 56
    menu = page.locator("header.site summary", has_text="Menu")
    expect(page.get_by_role("link", name="Workers")).to_be_hidden()
    menu.click()
    link = page.get_by_role("link", name="Workers")
    expect(link).to_be_visible()
    box = link.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
    _shot(page, "menu-open")
    page.keyboard.press("Escape")  # closes it, as a tap elsewhere does
    expect(link).to_be_hidden()
    menu.click()
    link.click()
    expect(page.get_by_role("heading", name="Workers")).to_be_visible()

    # The batches list: every batch's done, throughput and ETA on screen.
    for path in ("/", "/overview/"):
        page.goto(live_server.url + path)
        row = page.locator("table.batches tbody tr", has_text="Field interviews")
        for label in ("Done", "Throughput", "ETA"):
            cell = row.locator(f'td[data-label="{label}"]')
            expect(cell).to_be_visible()
            box = cell.bounding_box()
            assert box["x"] + box["width"] <= PHONE["width"], (path, label)
        expect(row.locator('td[data-label="ETA"]')).not_to_have_text("")
        _fits(page)

    # The items: one line of source, shortened in the middle, whole in the
    # tooltip; the file's name stays readable.
    page.goto(f"{live_server.url}/batches/{batch.pk}/")
    first = BatchItem.objects.filter(batch=batch).order_by("pk").first()
    source = page.locator("#items-live .mid").first
    expect(source).to_have_attribute("title", first.source)
    expect(source.locator(".mid-tail")).to_have_text("/interview-0000.wav")
    box = source.bounding_box()
    assert box["height"] < 24  # one line, not five fragments
    assert box["x"] + box["width"] <= PHONE["width"]
    head = source.locator(".mid-head")
    assert head.evaluate("el => el.scrollWidth > el.clientWidth")  # elided
    _fits(page)


# --- 11. The workers page refreshes ---------------------------------------------


def test_the_workers_page_refreshes_in_place(open_page, live_server):
    worker = make_worker("gpu-new")
    create_batch("Live", lambda: iter(["s3://a/one.wav\n"]))
    page = open_page(DESKTOP)
    page.goto(live_server.url + "/workers/")
    row = page.locator("table.workers tr", has_text="gpu-new")
    expect(row).to_contain_text("idle")
    expect(page.get_by_label("Refresh")).to_be_visible()
    page.evaluate("window.__marker = 'same page'")

    job = transitions.claim_next(worker)

    expect(row).to_contain_text("one.wav", timeout=10_000)
    expect(row).to_contain_text("expires in")
    transitions.complete(job, job.lease_token, worker=worker, result={"text": "x"})
    expect(row).to_contain_text("idle", timeout=10_000)
    expect(row.locator("td.num").first).to_have_text("1")
    assert page.evaluate("window.__marker") == "same page"  # never reloaded
    expect(page.locator("[data-refresh-status]")).to_have_text("live")


# --- 14. One bar on the batch page; charts with axes ----------------------------


def test_the_batch_page_has_one_bar_and_charts_with_axes(open_page, live_server):
    seeded = _an_afternoon()
    batch = seeded["batch"]
    page = open_page(DESKTOP)
    page.goto(f"{live_server.url}/batches/{batch.pk}/")
    summary = page.locator("#batch-live .summary")
    bars = summary.locator("svg.bar, progress")
    visible = [b for b in bars.all() if (box := b.bounding_box()) and box["width"] > 1]
    assert len(visible) == 1  # the segmented bar; the progress element is for AT
    expect(summary.get_by_role("progressbar", name="Items done")).to_have_count(1)
    assert_bar_painted(page, summary.locator("svg.bar"), _counts(batch), UI)

    chart = page.locator("#batch-live figure.chart")
    plot = chart.locator("svg").bounding_box()
    x_axis = chart.locator("[data-axis=x] span")
    expect(x_axis).to_have_text(["an hour ago", "30 min ago", "now"])
    first, last = x_axis.first.bounding_box(), x_axis.last.bounding_box()
    assert abs(first["x"] - plot["x"]) <= 1  # under the chart's left edge
    assert abs(last["x"] + last["width"] - (plot["x"] + plot["width"])) <= 1
    assert first["y"] >= plot["y"] + plot["height"]  # below it
    middle = x_axis.nth(1).bounding_box()
    assert abs(middle["x"] + middle["width"] / 2 - (plot["x"] + plot["width"] / 2)) <= 1
    y_axis = chart.locator("[data-axis=y] span")
    top = int(re.sub(r"\D", "", y_axis.first.inner_text()))
    expect(y_axis).to_have_text([f"{top}/min", "0"])
    assert top == 1  # the busiest minute of the batch's last hour
    high, zero = y_axis.first.bounding_box(), y_axis.last.bounding_box()
    assert high["y"] <= plot["y"] + 2  # level with the top of the plot
    assert zero["y"] + zero["height"] >= plot["y"] + plot["height"] - 2
    assert high["x"] + high["width"] <= plot["x"]  # left of it
    # The tallest bar reaches the top line.
    drawn = [box for r in chart.locator("rect").all() if (box := r.bounding_box())]
    tallest = min(box["y"] for box in drawn)
    assert abs(tallest - plot["y"]) <= 1


# --- 15. The favicon ------------------------------------------------------------


def test_a_first_visit_asks_for_no_missing_icon(open_page, live_server):
    page = open_page(DESKTOP, login=None)
    missing: list[str] = []
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    page.goto(live_server.url + "/accounts/login/")
    page.goto(live_server.url + "/admin/login/")
    response = page.request.get(live_server.url + "/favicon.ico")
    assert response.status == 200
    assert response.headers["content-type"] == "image/x-icon"
    assert missing == []
