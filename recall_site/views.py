"""Site-wide error views."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.defaults import server_error as html_server_error

from api.jsonapi import error_response


def server_error(request: HttpRequest) -> HttpResponse:
    """API clients get JSON even for an unexpected error; people get the page."""
    if request.path.startswith("/api/"):
        return error_response(
            500, "internal_error", "Unexpected server error; it was logged."
        )
    return html_server_error(request)
