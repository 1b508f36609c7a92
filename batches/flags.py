"""Quality flags: what a completed transcript looks wrong by, decided once.

The rules live here and nowhere else. The complete transition
(``jobs.transitions.complete``) calls ``flags_for`` with the worker's result and
the item's duration and requested language, and stores the answer on the item
(``BatchItem.flag_*``) and in the batch's counter rows (``BatchCounter.flag_*``)
in the same transaction; pages, the APIs and exports read what was stored.
An item that is not done has no flags; a re-completed one has those of its
latest completion.

- ``empty``: the transcript has no words.
- ``short``: the audio's duration is known and at least ``SHORT_MIN_MS`` (30 s),
  and the transcript has fewer than ``RECALL_MIN_WORDS_PER_MINUTE`` words per
  minute of it.
- ``language_mismatch``: the result names a ``language`` and the item's
  ``params.language`` names one, and they differ (ignoring case and spaces).

The rules are independent: an empty transcript of a long recording is both
``empty`` and ``short``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings

# In the order the per-batch counts are shown ({"empty": N, "short": N, ...}).
FLAGS = ("empty", "short", "language_mismatch")
# The column of each flag, on BatchItem (a boolean) and BatchCounter (a count).
FLAG_COLUMNS = {flag: f"flag_{flag}" for flag in FLAGS}
# Audio shorter than this is never "short": a few words may be all it holds.
SHORT_MIN_MS = 30_000


class UnknownFlag(ValueError):
    """A flag name that is not one of FLAGS (a filter asked for it)."""


def words(text: object) -> int:
    """Words in a transcript: runs of non-space characters (0 if not text)."""
    return len(text.split()) if isinstance(text, str) else 0


# What a language name is trimmed of before it is compared (the statement
# backend's COMPLETE trims the item's by the same characters).
SPACES = " \t\n\r\x0b\x0c"


def language_name(value: object) -> str | None:
    """A language name as compared: trimmed of SPACES and lower-cased; None
    for anything but a non-empty string."""
    if not isinstance(value, str) or not value.strip(SPACES):
        return None
    return value.strip(SPACES).lower()


def flags_for(
    result: Mapping[str, Any], *, duration_ms: int | None, language: object
) -> tuple[str, ...]:
    """The flags of a completion: ``result`` as the worker sent it (``text``,
    optional ``language``), ``duration_ms`` the item's (None: unknown),
    ``language`` the item's ``params.language`` (anything; only a non-empty
    string counts). Sorted names."""
    found = []
    n = words(result.get("text"))
    if n == 0:
        found.append("empty")
    per_minute = settings.RECALL_MIN_WORDS_PER_MINUTE
    # words / (ms / 60,000) < per_minute, in integers: no float at the boundary.
    if (
        duration_ms is not None
        and duration_ms >= SHORT_MIN_MS
        and n * 60_000 < per_minute * duration_ms
    ):
        found.append("short")
    heard = language_name(result.get("language"))
    asked = language_name(language)
    if heard is not None and asked is not None and heard != asked:
        found.append("language_mismatch")
    return tuple(sorted(found))


def flag_names(row: Mapping[str, Any] | object) -> list[str]:
    """The sorted flag names of an item (a BatchItem, or a values() dict with
    the ``flag_*`` columns)."""
    get = row.get if isinstance(row, Mapping) else lambda c: getattr(row, c)
    return sorted(flag for flag, column in FLAG_COLUMNS.items() if get(column))


def columns_for(flags: Iterable[str]) -> dict[str, bool]:
    """The item's flag columns for these flags (every column, True or False)."""
    chosen = set(flags)
    return {column: flag in chosen for flag, column in FLAG_COLUMNS.items()}


def parse_flag(value: str) -> str:
    """A flag filter's value, checked: UnknownFlag names the ones there are."""
    if value not in FLAGS:
        raise UnknownFlag(f"Unknown flag {value!r}: one of {', '.join(FLAGS)}."[:300])
    return value
