"""The admin's batch pages in a real browser: the progress changes in place
while a worker completes jobs, with the operator UI's refresh control, and the
colours follow the admin's theme (dark mode included)."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.support.browser import Api
from tests.support.factories import make_batch, make_user

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def admin_page(page: Page, live_server) -> Page:
    make_user("root", superuser=True)
    page.goto(f"{live_server.url}/admin/login/")
    page.get_by_label("Username").fill("root")
    page.get_by_label("Password").fill("pw")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Site administration")).to_be_visible()
    return page


def test_the_admins_batch_page_follows_a_worker(
    admin_page: Page, live_server, artifacts
):
    page = admin_page
    batch = make_batch(3, name="Admin batch")
    page.goto(f"{live_server.url}/admin/batches/batch/{batch.pk}/change/")
    region = page.locator("#batch-progress")
    expect(region.locator('[data-count="queued"]')).to_have_text("3")
    expect(page.get_by_label("Refresh")).to_be_visible()
    page.evaluate("window.__marker = 'same page'")
    api = Api(live_server.url)

    _, first = api.claim()
    expect(region.locator('[data-count="transcribing"]')).to_have_text(
        "1", timeout=10_000
    )
    expect(region.locator(".state")).to_have_text("running")
    api.complete(first["job"])
    expect(region.locator('[data-count="done"]')).to_have_text("1", timeout=10_000)
    expect(region.locator("[data-percent]")).to_have_text("33.3% done")
    expect(region.locator(".bar .seg-done")).to_have_count(1)
    page.screenshot(path=str(artifacts / "admin-batch.png"), full_page=True)
    for _ in range(2):
        _, job = api.claim()
        api.complete(job["job"])

    expect(region.locator(".state")).to_have_text("finished", timeout=10_000)
    expect(page.locator("#batch-progress")).to_have_attribute("data-live-final", "1")
    expect(page.locator("[data-refresh-status]")).to_have_text("up to date")
    assert page.evaluate("window.__marker") == "same page"  # never reloaded
    # The name and priority form is still there, untouched by the refreshes.
    expect(page.get_by_label("Name")).to_have_value("Admin batch")


def test_the_admins_batch_list_follows_a_worker(admin_page: Page, live_server):
    page = admin_page
    batch = make_batch(2, name="Listed batch")
    page.goto(f"{live_server.url}/admin/batches/batch/")
    row = page.locator("#result_list tr", has_text="Listed batch")
    expect(row.locator('[data-count="queued"]')).to_have_text("2")
    page.evaluate("window.__marker = 'same page'")
    api = Api(live_server.url)

    _, job = api.claim()
    expect(row.locator('[data-count="transcribing"]')).to_have_text("1", timeout=10_000)
    api.complete(job["job"])
    expect(row.locator('[data-count="done"]')).to_have_text("1", timeout=10_000)
    expect(row.locator(".field-done_percent")).to_have_text("50.0%")

    assert page.evaluate("window.__marker") == "same page"
    assert batch.pk == int(row.locator(".field-id").inner_text())


def test_the_colours_follow_the_admins_theme(admin_page: Page, live_server, artifacts):
    page = admin_page
    batch = make_batch(1, name="Themed batch")
    api = Api(live_server.url)
    _, job = api.claim()
    api.complete(job["job"])
    url = f"{live_server.url}/admin/batches/batch/{batch.pk}/change/"

    def done_colour() -> str:
        page.goto(url)
        segment = page.locator("#batch-progress .bar .seg-done")
        return segment.evaluate("el => getComputedStyle(el).backgroundColor")

    page.evaluate("localStorage.setItem('theme', 'light')")
    assert done_colour() == "rgb(30, 142, 62)"
    page.evaluate("localStorage.setItem('theme', 'dark')")
    assert done_colour() == "rgb(91, 185, 116)"
    track = page.locator("#batch-progress .bar").evaluate(
        "el => getComputedStyle(el).backgroundColor"
    )
    assert track == "rgb(33, 33, 33)"  # the admin's --darkened-bg, dark
    page.screenshot(path=str(artifacts / "admin-batch-dark.png"), full_page=True)
