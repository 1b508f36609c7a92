"""Quality flags in a real browser: an empty transcript arriving through the
worker API shows in the batch page's flag counts without a reload, and the
count's link lists the flagged item."""

import pytest
from playwright.sync_api import Page, expect

from tests.support.browser import Api

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


def test_flag_counts_are_visible_and_filter_the_items(
    logged_in: Page, live_server, tmp_path
):
    page = logged_in
    manifest = tmp_path / "manifest.csv"
    manifest.write_text(
        "source,duration_seconds,language\n/audio/0.wav,60,en\n/audio/1.wav,60,en\n"
    )
    page.get_by_role("link", name="New batch").first.click()
    page.get_by_label("Name").fill("Flagged batch")
    page.get_by_label("Manifest").set_input_files(str(manifest))
    page.get_by_role("button", name="Create batch").click()
    expect(page.get_by_role("heading", name="Flagged batch")).to_be_visible()
    empty = page.locator('[data-flag-count="empty"]')
    expect(empty).to_have_text("0")
    api = Api(live_server.url)

    status, body = api.claim()
    assert status == 200 and body is not None
    job = body["job"]
    status, _ = api.post(
        f"/api/v1/jobs/{job['id']}/complete",
        {"lease_token": job["lease_token"], "result": {"text": "", "language": "de"}},
    )
    assert status == 200

    expect(empty).to_have_text("1", timeout=10_000)
    expect(empty).to_be_visible()
    expect(page.locator('[data-flag-count="short"]')).to_have_text("1")
    expect(page.locator('[data-flag-count="language_mismatch"]')).to_have_text("1")
    page.locator("a:has([data-flag-count='short'])").click()
    expect(page.locator("#items-live tbody tr")).to_have_count(1)
    expect(page.locator('#items-live [data-flag="short"]')).to_be_visible()
