"""Real-browser tests: Debian's headless Chromium driven by Playwright.

Playwright's own browser download does not work here, so the system Chromium
is used. Without it these tests are skipped, unless RECALL_REQUIRE_BROWSER=1
(CI), which makes a missing browser a failure.
"""

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from jobs import transitions

from ..factories import make_user

# Playwright's sync API runs an event loop in the test thread; the ORM calls the
# tests make there are still plain synchronous calls.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


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


class Api:
    """A worker talking to the live server over real HTTP."""

    def __init__(self, base: str, name: str = "browser-test-worker"):
        _, self.token = transitions.create_worker(name)
        self.base = base

    def post(self, path: str, body: dict) -> tuple[int, dict | None]:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None

    def claim(self) -> tuple[int, dict | None]:
        return self.post("/api/v1/claim", {})

    def complete(self, job: dict) -> None:
        status, _ = self.post(
            f"/api/v1/jobs/{job['id']}/complete",
            {
                "lease_token": job["lease_token"],
                "result": {"text": "hello from the browser test"},
            },
        )
        assert status == 200


@pytest.fixture
def logged_in(page: Page, live_server) -> Page:
    make_user("operator", "Operators")
    page.goto(f"{live_server.url}/accounts/login/")
    page.get_by_label("Username").fill("operator")
    page.get_by_label("Password").fill("pw")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()  # landing page
    return page
