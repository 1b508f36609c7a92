"""Small template helpers for the operator pages."""

from __future__ import annotations

from django import template
from django.http import QueryDict

from engine.progress import format_duration

register = template.Library()


@register.filter
def duration(seconds: float | None) -> str:
    """Seconds as '2 h 05 min'; 'unknown' for None."""
    return format_duration(seconds)


@register.simple_tag
def query_with(query: str, **changes) -> str:
    """The query string with some parameters replaced (e.g. the page)."""
    params = QueryDict(query, mutable=True)
    for key, value in changes.items():
        params[key] = value
    return params.urlencode()


@register.filter
def until(moment, now) -> str:
    """'in 42 s' / '3 min ago' between two datetimes."""
    if moment is None:
        return ""
    delta = (moment - now).total_seconds()
    text = format_duration(abs(delta))
    return f"in {text}" if delta >= 0 else f"{text} ago"


@register.filter
def ms_duration(ms: int | None) -> str:
    """Milliseconds as a human duration."""
    return format_duration(None if ms is None else ms / 1000)
