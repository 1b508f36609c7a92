"""Security settings read at start-up, in production settings (a fresh process
each): the metrics token's minimum, HSTS for Recall's host only unless asked,
the session's idle lifetime; and `check --deploy` clean either way."""

from __future__ import annotations

import json

import pytest

from tests.support.settings import PRODUCTION, manage

SHOW = (
    "import json; from django.conf import settings as s; print(json.dumps(["
    "s.SECURE_HSTS_SECONDS, s.SECURE_HSTS_INCLUDE_SUBDOMAINS, s.SECURE_HSTS_PRELOAD, "
    "s.SESSION_COOKIE_AGE, s.RECALL_SESSION_IDLE_SECONDS, "
    "bool(s.RECALL_METRICS_TOKEN)]))"
)
# The header a client gets over HTTPS (any response: an API 401 needs neither
# a database nor collected static files).
HEADER = (
    "from django.test import Client; r = Client().get('/api/v1/batches', "
    "secure=True, HTTP_HOST='recall.example.com'); assert r.status_code == 401; "
    "print(r.headers['Strict-Transport-Security'])"
)
GOOD_TOKEN = "Zq8-metrics-" + "x7Kd2" * 4  # 32 characters


def shown(**env: str) -> list:
    result = manage("shell", "-v", "0", "-c", SHOW, env={**PRODUCTION, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("short-token", "it has 11 characters (9 different)"),
        ("k" * 31, "it has 31 characters (1 different)"),
        ("ab" * 20, "it has 40 characters (2 different)"),
        (GOOD_TOKEN[:-1], "it has 31 characters"),
    ],
)
def test_a_weak_metrics_token_stops_the_start(token, why):
    result = manage("check", env={**PRODUCTION, "RECALL_METRICS_TOKEN": token})

    assert result.returncode != 0
    assert f"RECALL_METRICS_TOKEN is too weak: {why}" in result.stderr
    assert "at least 32 (5 different) are needed" in result.stderr


def test_a_metrics_token_of_32_characters_or_none_starts():
    assert len(GOOD_TOKEN) == 32
    assert shown(RECALL_METRICS_TOKEN=GOOD_TOKEN)[-1] is True
    assert shown()[-1] is False  # unset: /metrics is off


def test_hsts_covers_recalls_host_only_unless_a_setting_says_more():
    assert shown()[:3] == [31536000, False, False]
    assert shown(SECURE_HSTS_INCLUDE_SUBDOMAINS="on")[:3] == [31536000, True, False]
    assert shown(SECURE_HSTS_INCLUDE_SUBDOMAINS="on", SECURE_HSTS_PRELOAD="on")[:3] == [
        31536000,
        True,
        True,
    ]

    header = manage("shell", "-v", "0", "-c", HEADER, env=PRODUCTION)
    both = manage(
        "shell", "-v", "0", "-c", HEADER,
        env={**PRODUCTION, "SECURE_HSTS_INCLUDE_SUBDOMAINS": "on",
             "SECURE_HSTS_PRELOAD": "on"},
    )  # fmt: skip

    assert header.returncode == 0, header.stderr
    assert header.stdout.strip() == "max-age=31536000"
    assert both.stdout.strip() == "max-age=31536000; includeSubDomains; preload"


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"SECURE_HSTS_INCLUDE_SUBDOMAINS": "on"},
        {"SECURE_HSTS_INCLUDE_SUBDOMAINS": "on", "SECURE_HSTS_PRELOAD": "on"},
        {"RECALL_METRICS_TOKEN": GOOD_TOKEN, "RECALL_SESSION_IDLE_SECONDS": "900"},
    ],
)
def test_check_deploy_stays_clean(extra):
    result = manage(
        "check", "--deploy", "--fail-level", "WARNING", env={**PRODUCTION, **extra}
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_a_session_ends_after_eight_idle_hours_unless_set():
    assert shown()[3:5] == [28800, 28800]
    assert shown(RECALL_SESSION_IDLE_SECONDS="900")[3:5] == [900, 900]
    short = manage("check", env={**PRODUCTION, "RECALL_SESSION_IDLE_SECONDS": "59"})
    assert short.returncode != 0
    assert "RECALL_SESSION_IDLE_SECONDS must be at least 60" in short.stderr
