"""Live regions: the fragments the pages' refreshing script swaps in place.

A fragment is rendered by the same template as its page, so every page works
without JavaScript; ``fragment`` marks the response so the script (and htmx)
knows it, and answers 286 once nothing will change any more, which ends the
polling (the operator UI, the admin and the overview all use it).
"""

from __future__ import annotations

from django.http import HttpResponse

# Status code that tells the refreshing script (and htmx) to stop polling.
STOP_POLLING = 286


def fragment(response: HttpResponse, *, final: bool) -> HttpResponse:
    """Mark a live fragment; 286 when it will not change any more."""
    response["X-Recall-Fragment"] = "1"
    response["Cache-Control"] = "no-store"
    if final:
        response.status_code = STOP_POLLING
    return response
