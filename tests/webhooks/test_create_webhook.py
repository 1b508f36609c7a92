"""manage.py create_webhook: the secret printed last, refusals create nothing."""

from __future__ import annotations

import io
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from jobs import webhook_keys as webhook_secrets
from jobs.models import WebhookEndpoint

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.django_db


def run(*args) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_it_prints_the_secret_last_and_keeps_it_encrypted(settings):
    settings.RECALL_WEBHOOK_ALLOW_PRIVATE = True
    out, err = run(
        "create_webhook",
        "http://127.0.0.1:9/hooks",
        "--events",
        "item.failed, batch.finished",
    )

    secret = out.strip().splitlines()[-1]
    endpoint = WebhookEndpoint.objects.get()
    assert secret.startswith("whsec_")
    assert webhook_secrets.decrypt(endpoint.secret_encrypted) == secret
    assert secret not in endpoint.secret_encrypted
    assert endpoint.url == "http://127.0.0.1:9/hooks"
    assert endpoint.event_types() == ["batch.finished", "item.failed"]
    assert endpoint.is_active
    assert "batch.finished, item.failed" in err


def test_batch_finished_is_the_default_subscription(settings):
    settings.RECALL_WEBHOOK_ALLOW_PRIVATE = True
    run("create_webhook", "http://127.0.0.1:9/")

    assert WebhookEndpoint.objects.get().event_types() == ["batch.finished"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ftp://example.com/"], "Only http:// and https://"),
        (["not a url"], "spaces"),
        (["http://localhost:9/"], "localhost resolves to .* loopback address"),
        (["http://169.254.169.254/"], "cloud metadata"),
        (["http://127.0.0.1:9/", "--events", "batch.started"], "Unknown event"),
        (["http://user:pw@127.0.0.1/"], "credentials"),
    ],
)
def test_refusals_are_clear_and_create_nothing(args, message):
    with pytest.raises(CommandError, match=message):
        run("create_webhook", *args)

    assert not WebhookEndpoint.objects.exists()


def test_a_refusal_exits_non_zero(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "RECALL_HTTPS": "off",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "create_webhook", "http://10.0.0.1/hooks"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode != 0
    assert result.stdout == ""
    assert "a private address" in result.stderr
    assert "Nothing was created" in result.stderr
