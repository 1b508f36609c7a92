"""Login throttling (django-axes): repeated failures lock a username out from the
address that failed, for a documented time, on the login page and the admin's;
an admin can unlock it; never a 500."""

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.contrib.auth.models import User
from django.test import Client

from tests.support.factories import make_user

pytestmark = pytest.mark.django_db

LOCKED = "This username was locked out after 5 failed logins from your address."


@pytest.fixture(autouse=True)
def _fast_hashes(settings):
    # Each login hashes a password (a failed one too): the fastest hasher keeps
    # forty logins quick. What is measured here is counting, not hashing.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def ana(db):
    return User.objects.create_user("ana", password="right-password-123")


def login(path="/accounts/login/", password="wrong", username="ana", ip="10.0.0.1"):
    client = Client()
    response = client.post(
        path, {"username": username, "password": password}, REMOTE_ADDR=ip
    )
    return client, response


def fail(times: int, **kwargs) -> list[int]:
    return [login(**kwargs)[1].status_code for _ in range(times)]


def test_five_failures_lock_the_username_out_from_that_address(ana):
    assert fail(4) == [200] * 4  # the form says the password did not match

    _, fifth = login()
    _, right = login(password="right-password-123")  # even the right password

    assert fifth.status_code == 429
    assert right.status_code == 429
    page = right.content.decode()
    assert LOCKED in page
    assert "Try again in 15 minutes" in page
    assert right["Retry-After"] == "900"
    assert "_auth_user_id" not in right.wsgi_request.session


def test_the_lockout_is_per_username_and_address(ana):
    make_user("ben")
    User.objects.filter(username="ben").update(password=ana.password)
    fail(5)

    _, other_address = login(password="right-password-123", ip="10.0.0.2")
    _, other_user = login(username="ben", password="right-password-123")

    assert other_address.status_code == 302
    assert other_user.status_code == 302


def test_the_admin_login_is_throttled_too(ana):
    ana.is_staff = True
    ana.save()

    statuses = fail(6, path="/admin/login/")

    assert statuses == [200] * 4 + [429, 429]
    assert AccessAttempt.objects.get().failures_since_start == 6


def test_the_lockout_ends_after_the_cool_off(ana):
    fail(5)
    # Time passes: the attempts are now older than the 15-minute cool-off.
    attempt = AccessAttempt.objects.get()
    AccessAttempt.objects.filter(pk=attempt.pk).update(
        attempt_time=attempt.attempt_time - timedelta(minutes=16)
    )

    _, response = login(password="right-password-123")

    assert response.status_code == 302


def test_an_admin_unlocks_it_by_deleting_the_attempts(ana):
    fail(5)
    admin = Client()
    admin.force_login(make_user("root", superuser=True))
    attempt = AccessAttempt.objects.get()

    page = admin.get("/admin/axes/accessattempt/")
    deleted = admin.post(
        f"/admin/axes/accessattempt/{attempt.pk}/delete/", {"post": "yes"}
    )
    _, response = login(password="right-password-123")

    assert page.status_code == 200
    assert "ana" in page.content.decode()
    assert deleted.status_code == 302
    assert response.status_code == 302


def test_a_success_before_the_limit_resets_the_count(ana):
    fail(4)
    login(password="right-password-123")

    assert fail(4) == [200] * 4


def test_odd_login_posts_are_never_a_500(ana):
    client = Client()
    for data in ({}, {"username": "ana"}, {"username": "x" * 10_000, "password": "p"},
                 {"username": "a\x00b", "password": "p"}):  # fmt: skip
        assert client.post("/accounts/login/", data).status_code == 200


def test_behind_a_proxy_the_address_is_the_one_the_proxy_appended(ana, settings):
    settings.RECALL_BEHIND_PROXY = True
    client = Client()

    def attempt(forwarded: str, password: str = "wrong") -> int:
        return client.post(
            "/accounts/login/",
            {"username": "ana", "password": password},
            REMOTE_ADDR="10.0.0.1",  # the proxy
            HTTP_X_FORWARDED_FOR=forwarded,
        ).status_code

    # A client forging the first entry cannot pose as a new address each time.
    assert [attempt(f"1.2.3.{n}, 203.0.113.7") for n in range(5)] == [200] * 4 + [429]
    assert attempt("9.9.9.9, 203.0.113.7", "right-password-123") == 429
    assert attempt("203.0.113.8", "right-password-123") == 302
    assert AccessAttempt.objects.get().ip_address == "203.0.113.7"
