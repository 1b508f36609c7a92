"""Real-browser tests: Debian's headless Chromium driven by Playwright.

Playwright's own browser download does not work here, so the system Chromium
is used. Without it these tests are skipped, unless RECALL_REQUIRE_BROWSER=1
(CI), which makes a missing browser a failure.
"""

import os
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from harness.server import ROOT
from tests.support.factories import make_user

# Playwright's sync API runs an event loop in the test thread; the ORM calls the
# tests make there are still plain synchronous calls.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"


def pytest_collection_modifyitems(config, items):
    if Path(CHROMIUM).exists():
        return
    if os.environ.get("RECALL_REQUIRE_BROWSER") == "1":
        raise pytest.UsageError(
            f"RECALL_REQUIRE_BROWSER=1 but there is no Chromium at {CHROMIUM}"
        )
    skip = pytest.mark.skip(reason="needs Chromium (apt-get install chromium)")
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    return {
        **browser_type_launch_args,
        "executable_path": CHROMIUM,
        "args": [
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ],
    }


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def logged_in(page: Page, live_server) -> Page:
    make_user("operator", "Operators")
    page.goto(f"{live_server.url}/accounts/login/")
    page.get_by_label("Username").fill("operator")
    page.get_by_label("Password").fill("pw")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()  # landing page
    return page
