"""Login throttling (django-axes): after repeated failures, a username is locked
out from the address that failed, for a while; an admin can unlock it sooner.

django-axes keeps the count (its AccessAttempt rows, in the admin under "Axes")
and refuses a locked-out pair before any password is checked; this module adapts
it to Recall: which address a request comes from, what a locked-out person sees,
and logins that do not come through a request.
"""

from __future__ import annotations

from axes.backends import AxesStandaloneBackend
from axes.helpers import get_cool_off
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


class LoginThrottleBackend(AxesStandaloneBackend):
    """django-axes' lockout check, for logins that come through a request (the
    login page and the admin's). An authentication without one (a script, the
    test client's ``login()``) has no address to lock out: it is left to the
    next backend, as if this one were not there."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username, password, **kwargs)


def client_ip(request: HttpRequest) -> str | None:
    """The address a login came from. Behind the reverse proxy that
    RECALL_BEHIND_PROXY trusts, the last X-Forwarded-For entry (the one that
    proxy appended; earlier ones are the client's to forge); else REMOTE_ADDR."""
    if settings.RECALL_BEHIND_PROXY:
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        if last := forwarded.rsplit(",", 1)[-1].strip():
            return last
    return request.META.get("REMOTE_ADDR")


# django-axes stores the username in a column of 255 characters; Django's login
# form does not enforce its 150 (a longer one reached the database: a 500).
MAX_USERNAME_CHARS = 255


def username(request: HttpRequest, credentials: dict | None = None) -> str | None:
    """The username a login attempt is counted under, at most 255 characters
    (no real username is that long: longer ones are counted as their prefix)."""
    source = credentials if credentials else request.POST
    value = source.get("username")
    return value[:MAX_USERNAME_CHARS] if isinstance(value, str) else value


def locked_out(request: HttpRequest, response=None, credentials=None) -> HttpResponse:
    """429 with a page that says what happened, for how long, and who can help."""
    cool_off = get_cool_off(request)
    minutes = max(1, round(cool_off.total_seconds() / 60)) if cool_off else None
    page = render(
        request,
        "registration/locked_out.html",
        {"minutes": minutes, "failures": settings.AXES_FAILURE_LIMIT},
        status=429,
    )
    if cool_off:
        page["Retry-After"] = str(int(cool_off.total_seconds()))
    return page
