"""Fixtures for the operator API: users in each role, each with an API token,
and a client for each (``ApiClient``, tests/support/clients.py)."""

from __future__ import annotations

import pytest

from tests.support.clients import ApiClient, token_for
from tests.support.factories import make_user


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
