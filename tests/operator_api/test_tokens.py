"""Where API tokens come from and go: the API tokens page (each user their
own), the admin (anyone's, revoked by an action) and create_api_token."""

from __future__ import annotations

import io
import re

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from django.test import Client

from operator_api.models import ApiToken
from tests.support.clients import ApiClient, token_for
from tests.support.factories import make_user

pytestmark = pytest.mark.django_db


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_page_needs_a_login(client):
    response = client.get("/api-tokens/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


def test_a_user_creates_a_token_shown_once_and_it_works(viewer):
    client = _client(viewer)

    response = client.post("/api-tokens/", {"label": "nightly"})

    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    page = response.content.decode()
    token = re.search(r'<code class="token">(rct_[\w-]+)</code>', page).group(1)
    row = ApiToken.objects.get(user=viewer)
    assert row.label == "nightly" and row.token_prefix == token[:12]
    assert ApiClient(token).get("/api/v1/batches").status_code == 200
    # Listed afterwards, but never again in clear.
    listing = client.get("/api-tokens/").content.decode()
    assert "nightly" in listing and token not in listing and token[:12] in listing
    assert 'aria-current="page"' in listing and ">API tokens</a>" in listing


def test_a_user_sees_and_revokes_only_their_own_tokens(viewer, operator):
    mine = token_for(viewer, "mine")
    theirs = token_for(operator, "theirs")
    their_row = ApiToken.objects.get(user=operator)
    client = _client(viewer)

    listing = client.get("/api-tokens/").content.decode()
    assert "mine" in listing and "theirs" not in listing

    assert client.post(f"/api-tokens/{their_row.pk}/revoke").status_code == 404
    assert ApiToken.objects.get(pk=their_row.pk).revoked_at is None

    my_row = ApiToken.objects.get(user=viewer)
    response = client.post(f"/api-tokens/{my_row.pk}/revoke")
    assert response.status_code == 302 and response["Location"] == "/api-tokens/"
    assert ApiToken.objects.get(pk=my_row.pk).revoked_at is not None
    assert ApiClient(mine).get("/api/v1/batches").status_code == 401
    assert ApiClient(theirs).get("/api/v1/batches").status_code == 200
    assert client.get(f"/api-tokens/{my_row.pk}/revoke").status_code == 405


def test_a_label_with_control_characters_is_refused(viewer):
    response = _client(viewer).post("/api-tokens/", {"label": "a\x07b"})
    assert response.status_code == 400
    assert ApiToken.objects.count() == 0


def test_the_admin_lists_and_revokes_anyones_tokens(viewer, operator):
    token_for(viewer, "v")
    token_for(operator, "o")
    admin = make_user("root", superuser=True)
    client = _client(admin)

    listing = client.get("/admin/operator_api/apitoken/")
    assert listing.status_code == 200
    assert (
        "viewer" in listing.content.decode() and "operator" in listing.content.decode()
    )
    assert client.get("/admin/operator_api/apitoken/add/").status_code == 403

    ids = list(ApiToken.objects.values_list("pk", flat=True))
    response = client.post(
        "/admin/operator_api/apitoken/",
        {"action": "revoke_tokens", "_selected_action": ids},
    )
    assert response.status_code == 302
    assert ApiToken.objects.filter(revoked_at__isnull=True).count() == 0
    assert LogEntry.objects.filter(change_message="Revoked.").count() == 2


def test_create_api_token_prints_the_token_last(operator):
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "create_api_token", "operator", "--name", "cron", stdout=out, stderr=err
    )

    token = out.getvalue().strip().splitlines()[-1]
    assert ApiToken.objects.get(user=operator).label == "cron"
    assert ApiClient(token).get("/api/v1/batches").status_code == 200
    assert "operator" in err.getvalue()


def test_create_api_token_refuses_an_unknown_user(db):
    with pytest.raises(CommandError, match=r"There is no user 'nobody'\."):
        call_command("create_api_token", "nobody")
