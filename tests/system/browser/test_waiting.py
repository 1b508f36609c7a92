"""A batch waiting for a worker, as a person sees it (issue 26): the batch
page, the batches list and the overview show "Waiting for a worker with …"
on screen, at 1400x900 and at 390x844, and no page scrolls sideways (the
labels are long; the workers page shows them too)."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import Browser, Locator, Page, expect

from engine.manifests import create_batch
from jobs import transitions
from jobs.models import Worker
from tests.support.factories import make_user

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]

SCREENSHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
DESKTOP = {"width": 1400, "height": 900}
PHONE = {"width": 390, "height": 844}
MODEL = "whisper-large-v3-turbo-de-finetuned-2026-11"  # a long value: it must wrap
WAITING = f"Waiting for a worker with model={MODEL}"


@pytest.fixture
def seeded(db):
    lines = [f"file:///audio/routed-{i}.wav\n" for i in range(4)]
    batch = create_batch(
        "routed", lambda: iter(lines), requires={"gpu": "a100", "model": MODEL}
    )
    worker, _ = transitions.create_worker("a100-small")
    Worker.objects.filter(pk=worker.pk).update(
        labels={"gpu": "a100", "model": "small", "zone": "eu-central-1"},
        last_seen=timezone.now(),
    )
    make_user("root", superuser=True)
    return batch


@pytest.fixture
def open_page(browser: Browser, live_server):
    opened = []

    def open_(viewport: dict) -> Page:
        context = browser.new_context(viewport=viewport)
        opened.append(context)
        page = context.new_page()
        page.goto(f"{live_server.url}/accounts/login/")
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


def _on_screen(page: Page, element: Locator) -> None:
    """Visible, and inside the window from side to side once scrolled to."""
    expect(element).to_be_visible()
    element.scroll_into_view_if_needed()
    box = element.bounding_box()
    assert box is not None
    width = page.viewport_size["width"]
    assert box["x"] >= 0 and box["x"] + box["width"] <= width, (page.url, box)


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1400x900", "390x844"])
def test_the_wait_is_on_screen_and_nothing_scrolls_sideways(
    open_page, live_server, seeded, viewport
):
    page = open_page(viewport)

    page.goto(f"{live_server.url}/batches/{seeded.pk}/")
    notice = page.locator("p[data-waiting]")
    expect(notice).to_contain_text(f"{WAITING}.")
    _on_screen(page, notice)
    expect(page.locator("[data-eta]")).to_have_text("— (waiting for a worker)")
    # A superuser may change the requirements: the form opens and fits too.
    page.get_by_text("Change the worker labels it requires").click()
    field = page.locator(".requires-form textarea[name=requires]")
    _on_screen(page, field)
    # Its help is not squeezed into a sliver beside it (on a phone it stacks).
    help_box = page.locator(".requires-form .muted.small").bounding_box()
    assert help_box is not None
    assert help_box["width"] >= field.bounding_box()["width"]
    _fits(page)
    _shot(page, "waiting-batch")

    for path in ("/", "/overview/"):
        page.goto(live_server.url + path)
        row = page.locator("div[data-waiting]")
        expect(row).to_have_text(WAITING)
        _on_screen(page, row)
        _fits(page)
        _shot(page, "waiting-" + (path.strip("/") or "batches"))

    page.goto(f"{live_server.url}/workers/")
    labels = page.locator("td[data-labels]")
    expect(labels).to_have_text("gpu=a100, model=small, zone=eu-central-1")
    _on_screen(page, labels)
    _fits(page)
    _shot(page, "waiting-workers")
