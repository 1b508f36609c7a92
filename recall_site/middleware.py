"""Site-wide middleware: health probes, the content security policy, sliding
session expiry, and a clear 503 when the database is down."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from csp.middleware import CSPMiddleware
from django.conf import settings
from django.contrib.auth import SESSION_KEY
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.utils import timezone
from whitenoise import middleware as whitenoise

from jobs.exceptions import DATABASE_DOWN
from recall_site.metrics import metrics_view

from . import health

log = logging.getLogger("recall.site")

# A lost or refused database connection: answered 503, not 500.


class ReleaseBodyMiddleware:
    """Let go of a request's body as soon as its response is made.

    Django's request is part of reference cycles (``request.user`` is a lazy
    object whose closure holds the request), so it is freed only when the
    garbage collector next breaks them, and with it the body it read: after
    twenty 5 MB claims a process was 95 MB larger. Dropping the body here
    frees it at once. Outermost, so that nothing after it reads the body."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            return self.get_response(request)
        finally:
            request.__dict__.pop("_body", None)
            request.__dict__.pop("_stream", None)


class HealthCheckMiddleware:
    """Answer /healthz and /readyz first, before host validation, sessions or
    HTTPS redirects: load balancers and Kubernetes probe by IP over plain HTTP.
    /metrics too, once RECALL_METRICS_TOKEN is set: Prometheus scrapes every
    node by its address (each node counts its own requests)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path == "/healthz":
            return health.healthz(request)
        if request.path == "/readyz":
            return health.readyz(request)
        if request.path == "/metrics" and settings.RECALL_METRICS_TOKEN:
            return metrics_view(request)
        return self.get_response(request)


# Move a session's expiry on at most this often: a save (one row written) per
# minute, not per page, for an expiry exact to within a minute.
SESSION_TOUCH_SECONDS = 60
# The live regions' refreshes say so (static/js/recall.js): not activity.
REFRESH_HEADER = ("X-Requested-With", "recall-refresh")


class SessionIdleMiddleware:
    """Sliding expiry: a login lasts ``RECALL_SESSION_IDLE_SECONDS``
    (``SESSION_COOKIE_AGE``) from its last request, not from the login.

    A request of a logged-in user whose session was last saved more than a
    minute ago (its stored expiry, ``recall_site.sessions``, says when) marks
    it modified, so Django saves it with a new expiry and sends the cookie
    again with a new max-age. The pages' automatic refreshes do not count: a
    tab left open must not keep a session alive. The APIs use tokens, not
    sessions, and are left alone."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith("/api/") and (
            request.headers.get(REFRESH_HEADER[0]) != REFRESH_HEADER[1]
        ):
            session = request.session
            if session.get(SESSION_KEY) is not None:
                expires = getattr(session, "expire_date", None)
                fresh = timedelta(
                    seconds=settings.SESSION_COOKIE_AGE - SESSION_TOUCH_SECONDS
                )
                if expires is None or expires - timezone.now() < fresh:
                    session.modified = True
        return self.get_response(request)


# The worker API (api/worker_views.py): bearer tokens, JSON, every view CSRF-exempt;
# no session, no Django user, no flash messages. Its paths, and nothing else's.
WORKER_API_PREFIXES = (
    "/api/v1/claim",
    "/api/v1/jobs/",
    "/api/v1/heartbeat",
    "/api/v1/complete",
)


class PagesOnly:
    """For a middleware that serves the pages only (the content security
    policy, static files, sessions, the logged-in user, flash messages): the
    worker API's requests pass it by.

    They answer JSON to programs (no policy), ask for no static file and
    never read a session, a user or a message, so these middlewares only set
    up lazy objects that nothing uses and, after the view, find nothing to
    save: no header, no cookie. Passing them by answers exactly the same, for
    about 215,000 instructions less a request, a seventh of a claim's or a
    completion's (the worker API carries every claim, heartbeat and
    completion). CSRF and django-axes' lockout stay as they are, though the
    worker API needs neither (its views are CSRF-exempt; it never logs in):
    Django's and django-axes' system checks look for their own classes in
    ``MIDDLEWARE``, and silencing a security check to save 40,000
    instructions would be a poor trade."""

    get_response: Callable[[HttpRequest], HttpResponse]

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path_info.startswith(WORKER_API_PREFIXES):
            return self.get_response(request)
        return super().__call__(request)  # type: ignore[misc]


class SessionMiddleware(PagesOnly, sessions.SessionMiddleware):
    """Django's, but for the worker API (``PagesOnly``)."""


class AuthenticationMiddleware(PagesOnly, auth.AuthenticationMiddleware):
    """Django's, but for the worker API (``PagesOnly``)."""


class MessageMiddleware(PagesOnly, messages.MessageMiddleware):
    """Django's, but for the worker API (``PagesOnly``)."""


class StaticFilesMiddleware(PagesOnly, whitenoise.WhiteNoiseMiddleware):
    """WhiteNoise's, but for the worker API (``PagesOnly``)."""


class ContentSecurityPolicyMiddleware(PagesOnly, CSPMiddleware):
    """django-csp's middleware, without the work for paths it excludes, and
    passed by for the worker API (``PagesOnly``).

    django-csp builds the policy for every response (twice: enforced and
    report-only) before it looks at ``EXCLUDE_URL_PREFIXES``: on the worker
    API, which answers JSON to programs, that was a twentieth of each call's
    time, for a header it then leaves out.
    """

    def process_response(self, request: HttpRequest, response: HttpResponse):
        policy = settings.CONTENT_SECURITY_POLICY
        if request.path_info.startswith(tuple(policy["EXCLUDE_URL_PREFIXES"])):
            return response
        return super().process_response(request, response)


class DatabaseUnavailableMiddleware:
    """Turn a lost database connection into 503 (JSON for the API), not a 500.

    Django reconnects by itself on the next request (CONN_HEALTH_CHECKS), so the
    same processes serve again as soon as the database is back.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception):
        if not isinstance(exception, DATABASE_DOWN):
            return None
        log.error("database unavailable: %s", exception)
        if request.path.startswith("/api/"):
            response = JsonResponse(
                {
                    "error": "unavailable",
                    "detail": "The database is unavailable; retry with backoff.",
                },
                status=503,
            )
        else:
            response = HttpResponse(render_to_string("503.html"), status=503)
        response["Retry-After"] = "5"
        return response
