"""What the README's quick start tells a newcomer (issue 27, item 16): how to
change the port and that workers follow it, that `make test` needs PostgreSQL
and how long it takes, a manifest written outside the checkout; the README
stays short and the docs site's home page shows it. (tests/test_quickstart.py
runs the commands.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
QUICK_START = README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]


def test_the_quick_start_says_how_to_change_the_port_and_the_workers_follow():
    assert "`RECALL_BIND=127.0.0.1:8080 make run`" in QUICK_START
    assert (
        "give workers the\nsame address in `RECALL_URL` "
        "(`RECALL_URL=http://127.0.0.1:8080`)"
    ) in QUICK_START


def test_the_quick_start_says_make_test_needs_postgresql_and_takes_a_while():
    block = re.findall(r"```sh\n(.*?)```", QUICK_START, re.DOTALL)[0]
    assert (
        "make test   # optional: the test suite, on PostgreSQL and on SQLite (15-25 min)"
        in block
    )
    assert "`make test` needs PostgreSQL" in QUICK_START
    assert "about 15-25 minutes on two cores" in QUICK_START


def test_the_quick_start_writes_no_file_into_the_checkout():
    commands = re.findall(r"```sh\n(.*?)```", QUICK_START, re.DOTALL)[1]
    targets = re.findall(r" >>? (\S+)", commands)  # redirections
    assert targets == ["/tmp/manifest.txt"]


def test_the_readme_stays_short_and_is_the_sites_home_page():
    assert len(README.splitlines()) <= 250
    assert '--8<-- "README.md:home"' in (ROOT / "docs" / "index.md").read_text()
    home = README.split("<!-- --8<-- [start:home] -->", 1)[1]
    assert "## Quick start" in home.split("<!-- --8<-- [end:home] -->", 1)[0]
