"""Admin fixtures: real staff users with real permissions, logged in with
Django's test client (actions are driven as the admin's own forms drive them,
by tests/support/admin.py)."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.support.admin import permission


@pytest.fixture
def staff(django_user_model):
    """``staff("alice", "jobs.view_job", ...)``: a staff user (not superuser)
    holding exactly these permissions, and a client logged in as them."""

    def make(username: str, *perms: str) -> tuple:
        user = django_user_model.objects.create_user(username, is_staff=True)
        user.user_permissions.set([permission(p) for p in perms])
        client = Client()
        client.force_login(user)
        return user, client

    return make
