"""Worker labels and the batch requirements matched against them.

A worker declares labels with each claim (``{"gpu": "a100"}``); a batch may
require some (``Batch.requires``). A worker may take a batch's jobs only when,
for every key the batch requires, its labels have that key with exactly that
value; extra labels never hurt, and a batch that requires nothing is open to
every worker. Both sides are checked by the same rules, here: keys match
``KEY``, values ``VALUE``, at most ``MAX_LABELS`` of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

KEY = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
VALUE = re.compile(r"[A-Za-z0-9_.:/-]{1,63}")
MAX_LABELS = 16

Labels = dict[str, str]


class LabelError(ValueError):
    """Labels (or requirements) that break the rules; the message says which."""


def clean_labels(value: Any, *, what: str = "labels") -> Labels:
    """``value`` as labels (a new dict), or LabelError saying what is wrong.

    ``None`` is no labels. Anything but an object of at most ``MAX_LABELS``
    string keys matching ``KEY`` to strings matching ``VALUE`` is refused.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise LabelError(f"{what} must be an object of KEY: VALUE strings")
    if len(value) > MAX_LABELS:
        raise LabelError(f"{what}: at most {MAX_LABELS} labels, got {len(value)}")
    labels: Labels = {}
    for key, val in value.items():
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise LabelError(
                f"{what}: key {key!r} must be 1 to 63 characters of a-z, 0-9, "
                "'_', '.' and '-', starting with a letter or digit"
            )
        if not isinstance(val, str) or not VALUE.fullmatch(val):
            raise LabelError(
                f"{what}: value of {key!r} must be 1 to 63 characters of "
                "A-Z, a-z, 0-9 and '_.:/-'"
            )
        labels[key] = val
    return dict(sorted(labels.items()))


def parse_pairs(pairs: Iterable[str], *, what: str = "labels") -> Labels:
    """``["gpu=a100", "model=large-v3"]`` (command-line or form syntax) as
    labels; LabelError for a pair without ``=``, a repeated key or a bad key or
    value."""
    labels: dict[str, str] = {}
    for pair in pairs:
        pair = pair.strip()
        if not pair:
            continue
        key, sep, val = pair.partition("=")
        key, val = key.strip(), val.strip()
        if not sep:
            raise LabelError(f"{what}: {pair!r} is not KEY=VALUE")
        if key in labels:
            raise LabelError(f"{what}: {key!r} is given twice")
        labels[key] = val
    return clean_labels(labels, what=what)


def format_pairs(labels: Mapping[str, str]) -> str:
    """Labels as the pairs people type: ``gpu=a100, model=large-v3``."""
    return ", ".join(f"{key}={val}" for key, val in sorted(labels.items()))


def satisfies(labels: Mapping[str, str], requires: Mapping[str, str]) -> bool:
    """True when labels offer every required key with exactly its value."""
    return all(labels.get(key) == val for key, val in requires.items())


def missing(labels: Mapping[str, str], requires: Mapping[str, str]) -> Labels:
    """The required pairs the labels do not offer."""
    return {key: val for key, val in requires.items() if labels.get(key) != val}
