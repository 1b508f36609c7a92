"""Rotating SECRET_KEY keeps every webhook secret: SECRET_KEY_FALLBACKS is read
from the environment (comma-separated, each key checked like SECRET_KEY), the
fallbacks decrypt, new encryptions use the current key, and
``manage.py reencrypt_webhook_secrets`` moves every secret to the current key
so the old one can go."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from jobs import transitions
from jobs import webhook_keys as keys
from jobs.models import WebhookEndpoint
from tests.support.factories import T0, make_endpoint

ROOT = Path(__file__).resolve().parents[2]
OLD_KEY = "old-" + "Kq7vT2xZ" * 7
NEW_KEY = "new-" + "Wm4pR9sB" * 7
OTHER_KEY = "other-" + "Hd3nF8cY" * 7


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


SHOW = "from django.conf import settings; print(settings.SECRET_KEY_FALLBACKS)"


def test_the_fallbacks_come_from_the_environment_and_are_checked(tmp_path):
    env = {
        "SECRET_KEY": NEW_KEY,
        "ALLOWED_HOSTS": "recall.example.com",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'settings.sqlite3'}",
    }

    listed = manage(
        "shell", "-v", "0", "-c", SHOW,
        env={**env, "SECRET_KEY_FALLBACKS": f" {OLD_KEY} , {OTHER_KEY},, "},
    )  # fmt: skip
    none = manage("shell", "-v", "0", "-c", SHOW, env=env)
    weak = manage("check", env={**env, "SECRET_KEY_FALLBACKS": f"{OLD_KEY},short"})
    insecure = manage(
        "check",
        env={**env, "SECRET_KEY_FALLBACKS": "django-insecure-" + "abcdefghij" * 5},
    )

    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == repr([OLD_KEY, OTHER_KEY])
    assert none.stdout.strip() == "[]"
    assert weak.returncode != 0
    assert (
        "SECRET_KEY_FALLBACKS: key 2 of 2 is too weak: it has 5 characters; at "
        "least 50 are needed" in weak.stderr
    )
    assert "short" not in weak.stderr.replace("is too weak", "")
    assert insecure.returncode != 0
    assert "key 1 of 1 is too weak: it starts with Django's" in insecure.stderr


def test_a_rotated_secret_key_keeps_webhooks_signing_across_processes(tmp_path):
    """The whole rotation as an operator does it, each step a new process."""
    base = {
        "ALLOWED_HOSTS": "recall.example.com",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'rotation.sqlite3'}",
        "RECALL_WEBHOOK_ALLOW_PRIVATE": "on",
    }
    before = {**base, "SECRET_KEY": OLD_KEY}
    rotated = {**base, "SECRET_KEY": NEW_KEY, "SECRET_KEY_FALLBACKS": OLD_KEY}
    after = {**base, "SECRET_KEY": NEW_KEY}
    read = (
        "from jobs.models import WebhookEndpoint; from jobs import webhook_keys as keys; "
        "print(keys.decrypt(WebhookEndpoint.objects.get().secret_encrypted))"
    )

    assert manage("migrate", "-v", "0", env=before).returncode == 0
    created = manage("create_webhook", "http://127.0.0.1:9/hooks", env=before)
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip().splitlines()[-1]

    # The new key with the old one as a fallback: the secret still decrypts.
    during = manage("shell", "-v", "0", "-c", read, env=rotated)
    assert during.returncode == 0, during.stderr
    assert during.stdout.strip() == secret

    # Without the fallback, before re-encrypting: nothing decrypts it, and
    # the command says so (exit status 1) and changes nothing.
    lost = manage("reencrypt_webhook_secrets", env=after)
    assert lost.returncode == 1
    assert json.loads(lost.stdout.splitlines()[-1])["unreadable"] == [1]
    assert "rotate their secrets" in lost.stderr

    moved = manage("reencrypt_webhook_secrets", env=rotated)
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout.splitlines()[-1]) == {
        "current": [],
        "reencrypted": [1],
        "unreadable": [],
    }

    # The old key can go now.
    done = manage("shell", "-v", "0", "-c", read, env=after)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == secret
    again = manage("reencrypt_webhook_secrets", env=after)
    assert json.loads(again.stdout.splitlines()[-1])["current"] == [1]


@pytest.mark.django_db
def test_reencryption_moves_both_secrets_to_the_current_key(settings):
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = OLD_KEY, []
    endpoint = make_endpoint()
    transitions.rotate_webhook_secret(endpoint, now=T0)  # a previous secret too
    stored = WebhookEndpoint.objects.get(pk=endpoint.pk)
    old = (
        keys.decrypt(stored.secret_encrypted),
        keys.decrypt(stored.previous_secret_encrypted),
    )
    untouched = make_endpoint("https://other.example/hooks")

    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = NEW_KEY, [OLD_KEY]
    fresh = make_endpoint("https://fresh.example/hooks")  # made after the rotation
    assert keys.is_current(
        WebhookEndpoint.objects.get(pk=fresh.pk).secret_encrypted
    )  # new encryptions use the current key, never a fallback
    out = io.StringIO()
    call_command("reencrypt_webhook_secrets", stdout=out)

    report = json.loads(out.getvalue().splitlines()[-1])
    assert report == {
        "current": [fresh.pk],
        "reencrypted": [endpoint.pk, untouched.pk],
        "unreadable": [],
    }
    settings.SECRET_KEY_FALLBACKS = []
    moved = WebhookEndpoint.objects.get(pk=endpoint.pk)
    assert keys.is_current(moved.secret_encrypted)
    assert keys.is_current(moved.previous_secret_encrypted)
    assert (
        keys.decrypt(moved.secret_encrypted),
        keys.decrypt(moved.previous_secret_encrypted),
    ) == old
    assert transitions.webhook_signing_secrets(moved, now=T0) == list(old)


@pytest.mark.django_db
def test_a_secret_no_key_decrypts_is_reported_and_left_alone(settings):
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = OTHER_KEY, []
    lost = make_endpoint()
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = NEW_KEY, [OLD_KEY]
    kept = make_endpoint("https://kept.example/hooks")
    before = WebhookEndpoint.objects.get(pk=lost.pk).secret_encrypted

    with pytest.raises(CommandError, match=rf"endpoint\(s\) \[{lost.pk}\]"):
        call_command("reencrypt_webhook_secrets", stdout=io.StringIO())

    assert WebhookEndpoint.objects.get(pk=lost.pk).secret_encrypted == before
    assert keys.decrypt(WebhookEndpoint.objects.get(pk=kept.pk).secret_encrypted) == (
        kept.secret
    )
