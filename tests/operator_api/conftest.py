"""Fixtures for the operator API: users in each role, each with an API token,
and a client that speaks to the API as a pipeline would (through the real
HTTP stack, with a bearer token and JSON bodies)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from jobs import transitions
from operator_api import tokens

from ..factories import make_user


class ApiClient:
    def __init__(self, token: str | None):
        self.token = token
        self.client = Client()

    def _auth(self, token: str | None) -> dict:
        token = self.token if token is None else token
        return {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}

    def get(self, path: str, *, token: str | None = None, **params):
        return self.client.get(path, params, **self._auth(token))

    def post(
        self,
        path: str,
        body=None,
        *,
        raw: bytes | None = None,
        token: str | None = None,
        headers: dict | None = None,
    ):
        data = raw if raw is not None else (b"" if body is None else json.dumps(body))
        return self.client.post(
            path,
            data=data,
            content_type="application/json",
            headers=headers or {},
            **self._auth(token),
        )


def token_for(user, label: str = "test") -> str:
    _, token = tokens.issue_token(user, label=label, now=transitions.now())
    return token


@pytest.fixture
def admin_user(db):
    return make_user("admin", superuser=True)


@pytest.fixture
def viewer_api(viewer) -> ApiClient:
    return ApiClient(token_for(viewer))


@pytest.fixture
def operator_api(operator) -> ApiClient:
    return ApiClient(token_for(operator))


@pytest.fixture
def stranger_api(stranger) -> ApiClient:
    return ApiClient(token_for(stranger))


@pytest.fixture
def admin_api(admin_user) -> ApiClient:
    return ApiClient(token_for(admin_user))
