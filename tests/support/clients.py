"""Clients for the pages and the Operator API: Django's test client logged in
as a user, and a client that speaks to the Operator API as a pipeline would
(through the real HTTP stack, with a bearer token and JSON bodies)."""

from __future__ import annotations

import json

from django.test import Client

from jobs import transitions
from operator_api import tokens


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def changer_client(name: str = "changer", *groups: str) -> tuple[Client, object]:
    """A client logged in as a user who may also change batches
    (``factories.make_changer``), and the user."""
    from tests.support.factories import make_changer

    user = make_changer(name, *groups)
    return client_for(user), user


def page_messages(response) -> list[str]:
    """The messages a rendered page shows (none when nothing was rendered)."""
    return [str(m) for m in response.context["messages"]] if response.context else []


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
