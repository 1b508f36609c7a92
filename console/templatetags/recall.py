"""Small template helpers for the operator pages."""

from __future__ import annotations

from collections.abc import Mapping

from django import template
from django.http import QueryDict

from batches.labels import format_pairs
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


# A source keeps at least this much of its end (the file's name) when it is
# shortened in the middle to fit.
SOURCE_TAIL = 20


@register.filter
def source_tail(source: str) -> str:
    """The end of a source that stays visible when the source is shortened in
    the middle: its file name, or its last characters when that is long."""
    name = source.rsplit("/", 1)[-1]
    if 0 < len(name) <= SOURCE_TAIL and len(name) < len(source):
        return "/" + name
    return source[-SOURCE_TAIL // 2 :] if len(source) > SOURCE_TAIL else ""


@register.filter
def source_head(source: str) -> str:
    """The rest of the source, in front of ``source_tail``: what is elided."""
    tail = source_tail(source)
    return source[: len(source) - len(tail)]


@register.filter
def pairs(labels) -> str:
    """Worker labels (or a batch's requirements) as ``gpu=a100, model=large-v3``;
    empty for none or for a stored value that is not an object."""
    return format_pairs(labels) if isinstance(labels, Mapping) else ""
