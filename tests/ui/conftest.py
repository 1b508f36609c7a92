import pytest
from django.test import Client

from tests.support.clients import client_for


@pytest.fixture
def viewer_client(viewer) -> Client:
    return client_for(viewer)


@pytest.fixture
def operator_client(operator) -> Client:
    return client_for(operator)
