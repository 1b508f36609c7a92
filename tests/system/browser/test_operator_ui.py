"""The operator's day, in a real browser: log in, create a batch by uploading a
manifest, watch a completion arrive through the worker API without reloading,
pause and resume, and see the refresh control and polling behave."""

import pytest
from playwright.sync_api import Page, expect

from tests.support.browser import Api
from tests.support.factories import make_user

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


def _create_batch(page: Page, live_server, tmp_path, lines: int = 3) -> None:
    manifest = tmp_path / "manifest.csv"
    manifest.write_text(
        "source,duration_seconds\n"
        + "".join(f"/audio/{i}.wav,{10 + i}\n" for i in range(lines))
    )
    page.get_by_role("link", name="New batch").first.click()
    page.get_by_label("Name").fill("Browser batch")
    page.get_by_label("Manifest").set_input_files(str(manifest))
    page.get_by_role("button", name="Create batch").click()
    expect(page.get_by_role("heading", name="Browser batch")).to_be_visible()


def test_counts_and_bar_update_without_a_reload(
    logged_in: Page, live_server, tmp_path, artifacts
):
    page = logged_in
    _create_batch(page, live_server, tmp_path)
    expect(page.locator('[data-count="queued"]')).to_have_text("3")
    page.evaluate("window.__marker = 'same page'")
    api = Api(live_server.url)

    status, body = api.claim()
    assert status == 200
    expect(page.locator('[data-count="transcribing"]')).to_have_text(
        "1", timeout=10_000
    )
    api.complete(body["job"])

    expect(page.locator('[data-count="done"]')).to_have_text("1", timeout=10_000)
    expect(page.locator('[data-count="queued"]')).to_have_text("2")
    expect(page.locator("[data-percent]")).to_have_text("33.3% done")
    expect(page.locator("#batch-live .bar .seg-done")).to_have_count(1)
    expect(page.locator("#items-live .state-done")).to_have_count(1)
    assert page.evaluate("window.__marker") == "same page"  # never reloaded
    page.screenshot(path=str(artifacts / "batch-page.png"), full_page=True)


def test_pause_and_resume(logged_in: Page, live_server, tmp_path):
    page = logged_in
    _create_batch(page, live_server, tmp_path)
    api = Api(live_server.url)

    page.get_by_role("button", name="Pause").click()

    expect(page.locator("#batch-live .headline .state")).to_have_text("paused")
    expect(page.get_by_role("status")).to_contain_text(
        "Paused: no new work is handed out"
    )
    assert api.claim()[0] == 204

    page.get_by_role("button", name="Resume").click()

    expect(page.locator("#batch-live .headline .state")).to_have_text("running")
    assert api.claim()[0] == 200


def test_refresh_control_and_polling_stop_when_finished(
    logged_in: Page, live_server, tmp_path
):
    page = logged_in
    _create_batch(page, live_server, tmp_path, lines=1)
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url) if "/live" in r.url else None)

    select = page.get_by_label("Refresh")
    expect(select).to_be_visible()
    with page.expect_request(lambda r: "/live" in r.url, timeout=10_000):
        pass
    select.select_option("off")
    page.wait_for_timeout(300)  # a fetch already in flight may still land
    before = len(requests)
    page.wait_for_timeout(5_000)  # longer than any interval: nothing may be fetched
    assert len(requests) == before
    expect(page.locator("[data-refresh-status]")).to_have_text("paused")

    # The choice is remembered across pages.
    page.reload()
    expect(page.get_by_label("Refresh")).to_have_value("off")
    page.get_by_label("Refresh").select_option("2")

    api = Api(live_server.url)
    _, body = api.claim()
    api.complete(body["job"])
    expect(page.locator("#batch-live .headline .state")).to_have_text(
        "finished", timeout=10_000
    )
    expect(page.locator("#batch-live")).to_have_attribute("data-live-final", "1")
    expect(page.locator("[data-refresh-status]")).to_have_text(
        "up to date", timeout=10_000
    )
    settled = len(requests)
    page.wait_for_timeout(5_000)
    assert len(requests) == settled


def test_pages_work_without_javascript(browser, live_server, tmp_path):
    make_user("viewer", "Viewers")
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(f"{live_server.url}/accounts/login/")
    page.get_by_label("Username").fill("viewer")
    page.get_by_label("Password").fill("pw")
    page.get_by_role("button", name="Log in").click()

    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    expect(page.locator("[data-refresh-control]")).to_be_hidden()
    context.close()


def test_no_polling_while_the_tab_is_hidden(logged_in: Page, live_server, tmp_path):
    page = logged_in
    _create_batch(page, live_server, tmp_path)
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url) if "/live" in r.url else None)
    with page.expect_request(lambda r: "/live" in r.url, timeout=10_000):
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
    page.wait_for_timeout(5_000)
    assert len(requests) == before

    # Visible again: it refreshes at once.
    with page.expect_request(lambda r: "/live" in r.url, timeout=3_000):
        page.evaluate(
            """() => {
                Object.defineProperty(document, "visibilityState", {configurable: true, get: () => "visible"});
                document.dispatchEvent(new Event("visibilitychange"));
            }"""
        )


def test_pages_keep_the_content_security_policy(logged_in: Page, live_server, tmp_path):
    # Every CSP violation the browser reports (an inline style or script it
    # refused) is collected; there must be none, on any page an operator uses.
    page = logged_in
    page.add_init_script(
        "window.__violations = [];"
        "document.addEventListener('securitypolicyviolation', (e) =>"
        " window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));"
    )
    _create_batch(page, live_server, tmp_path)
    api = Api(live_server.url)
    status, body = api.claim()
    assert status == 200
    api.complete(body["job"])
    expect(page.locator('[data-count="done"]')).to_have_text("1", timeout=10_000)

    done = page.locator("#batch-live svg.bar .seg-done")
    queued = page.locator("#batch-live svg.bar .seg-queued")
    assert done.get_attribute("d") == "M0.000 0h33.300v1H0.000z"
    assert queued.get_attribute("d") == "M33.300 0h66.700v1H33.300z"
    # Drawn as it says: the done segment is a third of the bar, the queued one
    # starts where it ends.
    bar = page.locator("#batch-live svg.bar").bounding_box()
    done_box, queued_box = done.bounding_box(), queued.bounding_box()
    assert abs(done_box["width"] - bar["width"] / 3) < 2
    assert abs(queued_box["x"] - (done_box["x"] + done_box["width"])) < 1
    assert done_box["height"] == bar["height"]
    assert page.evaluate("window.__violations") == []
    for path in ("/", "/workers/", "/batches/new/", "/admin/"):
        page.goto(live_server.url + path)
        assert page.evaluate("window.__violations") == [], path
