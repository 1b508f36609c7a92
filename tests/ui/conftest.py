import pytest
from django.test import Client


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def viewer_client(viewer) -> Client:
    return client_for(viewer)


@pytest.fixture
def operator_client(operator) -> Client:
    return client_for(operator)
