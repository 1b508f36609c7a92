import pytest
from django.test import Client

from ..factories import make_user


@pytest.fixture
def viewer(db):
    return make_user("viewer", "Viewers")


@pytest.fixture
def operator(db):
    return make_user("operator", "Operators")


@pytest.fixture
def stranger(db):
    """Logged in, but in no group: may see nothing."""
    return make_user("stranger")


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
