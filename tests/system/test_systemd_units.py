"""deploy/systemd/: the units pass ``systemd-analyze verify`` (with their paths
pointed at this checkout, whose virtualenv stands for /opt/recall's), restart
on failure, run as a dedicated user with the hardening options that fit, and
score "OK" or better in ``systemd-analyze security``; the environment-file
example sets only settings the configuration reference documents."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack import DEPLOY, ROOT, need

# No database needed, but run once: in the PostgreSQL pass, with the others.
pytestmark = pytest.mark.postgres

UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
VENV = Path(sys.executable).parent.parent


def installed(tmp_path: Path) -> list[Path]:
    """The units as installed from this checkout: /opt/recall is here."""
    paths = []
    for unit in UNITS:
        text = unit.read_text().replace("/opt/recall/.venv", str(VENV))
        path = tmp_path / unit.name
        path.write_text(text.replace("/opt/recall", str(ROOT)))
        paths.append(path)
    return paths


def test_there_is_a_unit_for_the_web_server_and_one_for_the_cluster():
    assert [unit.name for unit in UNITS] == [
        "recall-cluster.service",
        "recall-web.service",
    ]


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.name)
def test_each_unit_restarts_on_failure_as_a_dedicated_hardened_user(unit):
    lines = set(unit.read_text().splitlines())
    for setting in (
        "User=recall",
        "Group=recall",
        "Restart=on-failure",
        "EnvironmentFile=/etc/recall/recall.env",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "StateDirectory=recall",
        "WantedBy=multi-user.target",
    ):
        assert setting in lines, setting


def test_systemd_analyze_verifies_the_units_and_rates_them(tmp_path):
    analyze = need("systemd-analyze")
    units = installed(tmp_path)
    verified = subprocess.run(
        [analyze, "verify", "--man=no", *map(str, units)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # Unknown keys and bad values are only warned about: any word fails.
    assert (verified.returncode, verified.stdout + verified.stderr) == (0, "")
    for unit in units:
        rated = subprocess.run(
            [analyze, "security", "--offline=yes", str(unit)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        level = re.search(
            r"Overall exposure level for \S+: ([\d.]+) (\w+)", rated.stdout
        )
        assert level, rated.stdout + rated.stderr
        print(f"systemd: {unit.name} exposure {level[1]} {level[2]}")
        assert float(level[1]) <= 4.0  # systemd's "OK" band ends at 4.9


def test_a_typo_in_a_unit_is_caught(tmp_path):
    analyze = need("systemd-analyze")
    unit = installed(tmp_path)[1]
    unit.write_text(unit.read_text().replace("ProtectSystem=", "ProtectSystm="))
    verified = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "Unknown key 'ProtectSystm'" in verified.stderr


def test_the_environment_file_sets_only_documented_settings():
    example = (DEPLOY / "systemd" / "recall.env.example").read_text()
    names = re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", example, re.MULTILINE)
    reference = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert "DATABASE_URL" in names and "SECRET_KEY" in names
    assert [name for name in names if f"`{name}`" not in reference] == []
