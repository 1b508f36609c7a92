"""Search in a real browser: the navigation's Search page finds a hostile
transcript by its words, shows it as text (its script never runs) with the
words marked, and says where the first segment with them starts."""

import pytest
from playwright.sync_api import Page, expect

from jobs import transitions
from tests.support.factories import claim, later, make_batch, make_worker

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


def test_the_search_page_marks_the_words_of_a_hostile_transcript(
    logged_in: Page, live_server
):
    page = logged_in
    make_batch(1, name="Hostile calls")
    worker = make_worker("gpu-browser-search")
    job = claim(worker, now=later(1))
    text = "hello <img src=x onerror=\"document.title='pwned'\"> about the refund"
    transitions.complete(
        job,
        job.lease_token,
        worker=worker,
        result={
            "text": text,
            "segments": [
                {"start": 0, "end": 2, "text": "hello"},
                {"start": 125, "end": 130, "text": "about the refund"},
            ],
        },
        now=later(2),
    )
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))

    page.get_by_role("link", name="Search").first.click()
    page.get_by_label("Words").fill("REFUND about")
    page.get_by_role("button", name="Search").click()

    hit = page.locator(".hit")
    expect(hit).to_have_count(1)
    expect(hit.get_by_role("link", name="Hostile calls")).to_be_visible()
    expect(hit.locator("mark")).to_have_text(["about", "refund"])
    expect(hit.locator(".snippet")).to_contain_text("<img src=x onerror=")
    expect(hit.locator(".hit-start")).to_have_text("at 2:05")
    assert hit.locator(".snippet img").count() == 0
    assert page.title() != "pwned"
    assert dialogs == []
