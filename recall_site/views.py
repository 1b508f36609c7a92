"""Site-wide views: errors, and the icon browsers ask for."""

from __future__ import annotations

from functools import cache

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from django.views.defaults import server_error as html_server_error

from api.jsonapi import error_response


def server_error(request: HttpRequest) -> HttpResponse:
    """API clients get JSON even for an unexpected error; people get the page."""
    if request.path.startswith("/api/"):
        return error_response(
            500, "internal_error", "Unexpected server error; it was logged."
        )
    return html_server_error(request)


@cache
def _favicon() -> bytes:
    return (settings.BASE_DIR / "static" / "favicon.ico").read_bytes()


@require_GET
def favicon(request: HttpRequest) -> HttpResponse:
    """/favicon.ico, which every browser asks for (the admin's pages name no
    icon): served, so a first visit logs no 404."""
    response = HttpResponse(_favicon(), content_type="image/x-icon")
    response["Cache-Control"] = "public, max-age=86400"
    return response
