"""Operator API: who may do what (a token carries its user's permissions), and
that API tokens and worker tokens are not interchangeable."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User

from batches.models import Batch
from jobs import transitions
from operator_api import tokens
from operator_api.models import ApiToken
from tests.support.clients import ApiClient, token_for
from tests.support.factories import make_batch, make_worker

pytestmark = pytest.mark.django_db

SUBMISSION = {"name": "api", "items": [{"source": "file:///a.wav"}]}

# (method, path, body, who may: "read" for Viewers and up, "write" for Operators)
ENDPOINTS = [
    ("GET", "/api/v1/batches", None, "read"),
    ("POST", "/api/v1/batches", SUBMISSION, "write"),
    ("GET", "/api/v1/batches/{id}", None, "read"),
    ("GET", "/api/v1/batches/{id}/items", None, "read"),
    ("GET", "/api/v1/batches/{id}/export.csv", None, "write"),
    ("GET", "/api/v1/batches/{id}/export.jsonl", None, "write"),
    ("GET", "/api/v1/batches/{id}/export.zip", None, "write"),
    ("POST", "/api/v1/batches/{id}/pause", None, "write"),
    ("POST", "/api/v1/batches/{id}/resume", None, "write"),
    ("POST", "/api/v1/batches/{id}/retry", {"source_contains": "x"}, "write"),
    ("POST", "/api/v1/batches/{id}/cancel", None, "write"),
]
ALLOWED = {
    "stranger": set(),
    "viewer": {"read"},
    "operator": {"read", "write"},
    "admin": {"read", "write"},
}


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert set(body) == {"error", "detail"}
    assert body["error"] == code
    assert body["detail"]
    return body


def _call(api: ApiClient, method: str, path: str, body, **kwargs):
    response = (
        api.get(path, **kwargs) if method == "GET" else api.post(path, body, **kwargs)
    )
    if response.streaming:
        # Read to the end, as a client does: the export's slot is given back.
        b"".join(response.streaming_content)
    return response


@pytest.mark.parametrize("role", ["stranger", "viewer", "operator", "admin"])
@pytest.mark.parametrize(("method", "path", "body", "needs"), ENDPOINTS)
def test_each_role_may_do_exactly_what_its_permissions_allow(
    request, role, method, path, body, needs
):
    api = request.getfixturevalue(f"{role}_api")
    batch = make_batch(2, name="existing")
    path = path.format(id=batch.pk)

    response = _call(api, method, path, body)

    allowed = needs in ALLOWED[role]
    if allowed:
        assert response.status_code in (200, 201), response.content
    else:
        body = _error(response, 403, "forbidden")
        assert body["detail"].startswith(f"User {role!r} may not do this (it needs")
    # Only a submission allowed to creates a batch.
    submitted = allowed and (method, path) == ("POST", "/api/v1/batches")
    assert Batch.objects.count() == (2 if submitted else 1)


@pytest.mark.parametrize(("method", "path", "body", "needs"), ENDPOINTS)
def test_no_token_unknown_token_and_a_worker_token_are_401(
    operator_api, method, path, body, needs
):
    batch = make_batch(1)
    path = path.format(id=batch.pk)
    worker = make_worker("gpu-1")

    for token in ("", "rct_" + "x" * 43, worker.token, "not-a-token"):
        response = _call(ApiClient(token or None), method, path, body)
        _error(response, 401, "unauthorized")
        assert response["WWW-Authenticate"].startswith("Bearer")
    assert Batch.objects.count() == 1


def test_a_worker_token_is_told_it_is_not_an_api_token(operator_api):
    worker = make_worker("gpu-1")
    response = ApiClient(worker.token).get("/api/v1/batches")
    assert _error(response, 401, "unauthorized")["detail"] == (
        "This is not an API token (they start with 'rct_'); worker tokens are "
        "refused here."
    )


def test_an_api_token_is_refused_by_the_worker_api(operator_api):
    make_batch(1)
    response = operator_api.post("/api/v1/claim", {})
    assert response.status_code == 401
    assert response.json() == {
        "error": "unauthorized",
        "detail": "Unknown worker token.",
    }


def test_a_revoked_token_is_refused_at_once(operator, operator_api):
    assert operator_api.get("/api/v1/batches").status_code == 200
    api_token = ApiToken.objects.get(user=operator)

    assert (
        tokens.revoke(ApiToken.objects.filter(pk=api_token.pk), now=transitions.now())
        == 1
    )

    body = _error(operator_api.get("/api/v1/batches"), 401, "unauthorized")
    assert body["detail"] == "This API token was revoked."
    # Revoking again changes nothing.
    assert (
        tokens.revoke(ApiToken.objects.filter(pk=api_token.pk), now=transitions.now())
        == 0
    )


def test_a_deactivated_users_token_is_refused(operator, operator_api):
    User.objects.filter(pk=operator.pk).update(is_active=False)
    body = _error(operator_api.get("/api/v1/batches"), 401, "unauthorized")
    assert body["detail"] == "This API token's user is deactivated."


def test_a_token_follows_its_users_permissions_as_they_change(viewer, viewer_api):
    assert viewer_api.post("/api/v1/batches", SUBMISSION).status_code == 403
    viewer.groups.set([Group.objects.get(name="Operators")])

    assert viewer_api.post("/api/v1/batches", SUBMISSION).status_code == 201


def test_last_used_is_recorded_at_most_once_a_minute(operator):
    token = token_for(operator)
    api_token = ApiToken.objects.get(user=operator)
    assert api_token.last_used is None

    ApiClient(token).get("/api/v1/batches")
    first = ApiToken.objects.get(pk=api_token.pk).last_used
    assert first is not None

    ApiClient(token).get("/api/v1/batches")
    assert ApiToken.objects.get(pk=api_token.pk).last_used == first

    ApiToken.objects.filter(pk=api_token.pk).update(
        last_used=first - timedelta(minutes=2)
    )
    ApiClient(token).get("/api/v1/batches")
    assert ApiToken.objects.get(pk=api_token.pk).last_used > first - timedelta(
        minutes=2
    )


def test_only_the_hash_is_stored(operator):
    token = token_for(operator)
    row = ApiToken.objects.get(user=operator)
    assert token.startswith("rct_") and len(token) == 47
    assert row.token_prefix == token[:12]
    assert token not in row.token_hash and len(row.token_hash) == 64


def test_a_malformed_authorization_header_is_401(operator_api):
    for header in ("Basic abc", "Bearer", "Bearer    ", "rct_abc"):
        response = operator_api.client.get("/api/v1/batches", HTTP_AUTHORIZATION=header)
        _error(response, 401, "unauthorized")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("PUT", "/api/v1/batches"),
        ("DELETE", "/api/v1/batches/1"),
        ("POST", "/api/v1/batches/1/items"),
        ("GET", "/api/v1/batches/1/pause"),
    ],
)
def test_other_methods_are_405_with_allow(operator_api, method, path):
    response = getattr(operator_api.client, method.lower())(
        path, HTTP_AUTHORIZATION=f"Bearer {operator_api.token}"
    )
    body = _error(response, 405, "method_not_allowed")
    assert response["Allow"] in ("GET, POST", "GET", "POST")
    assert method in body["detail"]
