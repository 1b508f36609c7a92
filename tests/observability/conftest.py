from __future__ import annotations

import pytest
from django.test import Client

from tests.support.factories import make_user


@pytest.fixture
def viewer_client(db) -> Client:
    client = Client()
    client.force_login(make_user("viewer", "Viewers"))
    return client
