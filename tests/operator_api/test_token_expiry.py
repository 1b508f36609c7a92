"""API tokens can be given an expiry (``create_api_token --expires-days N``, the
API tokens page) and are refused from then on, with a 401 that says so; a
deactivated user's tokens are refused too."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from jobs import transitions
from operator_api import tokens
from operator_api.models import ApiToken
from tests.support.clients import ApiClient
from tests.support.factories import make_user

pytestmark = pytest.mark.django_db

LIST = "/api/v1/batches"


def refused(response) -> str:
    assert response.status_code == 401, response.content
    assert response["WWW-Authenticate"] == (
        'Bearer realm="recall", error="invalid_token"'
    )
    body = response.json()
    assert body["error"] == "unauthorized"
    return body["detail"]


def test_a_token_works_until_its_expiry_and_is_refused_from_then_on(viewer):
    now = transitions.now()
    api_token, token = tokens.issue_token(
        viewer, label="ci", now=now, expires_in_days=30
    )
    api = ApiClient(token)
    assert api_token.expires_at == now + timedelta(days=30)
    assert api.get(LIST).status_code == 200

    # Its expiry comes: from that moment, 401 (the database's clock decides).
    moment = transitions.now() - timedelta(seconds=1)
    ApiToken.objects.filter(pk=api_token.pk).update(expires_at=moment)

    assert refused(api.get(LIST)) == (
        f"This API token expired at {moment.isoformat()}; create a new one on "
        f"the API tokens page."
    )
    assert refused(api.post(f"{LIST}/1/pause")).startswith("This API token expired")
    # A token without an expiry is unaffected.
    assert ApiClient(tokens.issue_token(viewer, now=now)[1]).get(LIST).status_code == (
        200
    )


def test_a_deactivated_users_tokens_are_refused(viewer):
    _, token = tokens.issue_token(viewer, now=transitions.now(), expires_in_days=5)
    api = ApiClient(token)
    assert api.get(LIST).status_code == 200

    viewer.is_active = False
    viewer.save()

    assert refused(api.get(LIST)) == "This API token's user is deactivated."
    viewer.is_active = True
    viewer.save()
    assert api.get(LIST).status_code == 200


@pytest.mark.parametrize("days", [0, -1, 3651])
def test_an_expiry_out_of_range_is_refused(viewer, days):
    with pytest.raises(ValueError, match="from 1 to 3650"):
        tokens.issue_token(viewer, now=transitions.now(), expires_in_days=days)
    assert not ApiToken.objects.exists()


def test_create_api_token_takes_an_expiry_in_days(viewer):
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "create_api_token", "viewer", "--expires-days", "7", stdout=out, stderr=err
    )

    api_token = ApiToken.objects.get()
    assert api_token.expires_at == api_token.created_at + timedelta(days=7)
    assert f"valid until {api_token.expires_at.isoformat()}" in err.getvalue()
    assert ApiClient(out.getvalue().strip()).get(LIST).status_code == 200

    call_command("create_api_token", "viewer", stdout=io.StringIO(), stderr=err)
    assert ApiToken.objects.filter(expires_at__isnull=True).count() == 1


@pytest.mark.parametrize(
    "value", ["0", "-3", "abc", "3651", "1.5", "²", "1" + "0" * 5000]
)
def test_create_api_token_refuses_a_bad_expiry_and_creates_nothing(viewer, value):
    with pytest.raises(CommandError, match="--expires-days takes a whole number"):
        call_command(
            "create_api_token", "viewer", "--expires-days", value,
            stdout=io.StringIO(), stderr=io.StringIO(),
        )  # fmt: skip
    assert not ApiToken.objects.exists()


def test_the_tokens_page_creates_expiring_tokens_and_shows_their_state(viewer):
    client = Client()
    client.force_login(viewer)

    page = client.post("/api-tokens/", {"label": "weekly", "expires_in_days": "7"})
    assert page.status_code == 200
    made = ApiToken.objects.get(label="weekly")
    assert made.expires_at == made.created_at + timedelta(days=7)

    bad = client.post("/api-tokens/", {"label": "bad", "expires_in_days": "0"})
    assert bad.status_code == 400
    assert "greater than or equal to 1" in bad.content.decode()
    assert not ApiToken.objects.filter(label="bad").exists()

    ApiToken.objects.filter(pk=made.pk).update(
        expires_at=transitions.now() - timedelta(minutes=1)
    )
    tokens.issue_token(viewer, label="forever", now=transitions.now())
    listing = client.get("/api-tokens/").content.decode()
    rows = {
        label: listing.split(f'<th scope="row">{label}</th>', 1)[1].split("</tr>")[0]
        for label in ("weekly", "forever")
    }
    assert '<span class="state state-failed">expired</span>' in rows["weekly"]
    assert '<span class="muted">never</span>' in rows["forever"]
    assert '<span class="state state-done">active</span>' in rows["forever"]


def test_the_admin_lists_each_tokens_expiry(viewer):
    tokens.issue_token(viewer, label="ci", now=transitions.now(), expires_in_days=3)
    admin = Client()
    admin.force_login(make_user("root", superuser=True))

    listing = admin.get("/admin/operator_api/apitoken/").content.decode()

    assert "column-expires_at" in listing
