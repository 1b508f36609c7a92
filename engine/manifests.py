"""Batch intake: parse a manifest, validate all of it, then create everything.

A manifest is either plain text (one source per line; blank lines and lines
starting with ``#`` are skipped) or CSV whose header has a ``source`` column.
In CSV, an optional ``duration_seconds`` column is kept for the ETA and every
other column goes into the item's ``params``.

Nothing is created unless the whole manifest is valid: the file is read twice,
once to collect every error (with its line number) and once, inside the intake
transition (``jobs.transitions.create_batch``: one transaction), to insert the
batch, its items, their jobs and the counters.
"""

from __future__ import annotations

import codecs
import csv
import re
import unicodedata
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain

from django.conf import settings

from batches.models import Batch
from batches.numbers import is_number, shown
from jobs import transitions
from jobs.transitions import ItemRow

MAX_SOURCE_CHARS = 4096
MAX_PARAM_CHARS = 10_000
MAX_NAME_CHARS = 200
MAX_DURATION_SECONDS = 10_000_000  # about 115 days: anything longer is a typo
MAX_REPORTED_ERRORS = 100


@dataclass(frozen=True)
class Entry:
    line: int
    source: str
    params: dict
    duration_ms: int | None


@dataclass(frozen=True)
class LineError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


@dataclass
class ManifestInvalid(Exception):
    errors: list[LineError]
    total_errors: int = 0
    items: int = 0

    def __post_init__(self) -> None:
        self.total_errors = self.total_errors or len(self.errors)

    def __str__(self) -> str:
        lines = [str(e) for e in self.errors]
        if self.total_errors > len(self.errors):
            lines.append(f"… and {self.total_errors - len(self.errors)} more errors")
        return "\n".join(lines)


def parse_manifest(lines: Iterable[bytes | str]) -> Iterator[Entry | LineError]:
    """Yield one Entry per source, or a LineError per problem, in file order."""
    text = _decoded(lines)
    skipped: list[tuple[int, str | LineError]] = []
    for number, line in text:
        if isinstance(line, str) and (
            not line.strip() or line.lstrip().startswith("#")
        ):
            skipped.append((number, line))
            continue
        if isinstance(line, str) and "source" in (
            c.strip().lower() for c in _csv_row(line)
        ):
            yield from _parse_csv(number, chain([line], (line for _, line in text)))
        else:
            yield from _parse_lines(chain(skipped, [(number, line)], text))
        return
    yield from _parse_lines(skipped)


def _decoded(lines: Iterable[bytes | str]) -> Iterator[tuple[int, str | LineError]]:
    for number, raw in enumerate(lines, 1):
        if isinstance(raw, bytes):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield number, LineError(number, "not valid UTF-8 text")
                continue
        elif number == 1:
            raw = raw.removeprefix("\ufeff")
        yield number, raw


def _csv_row(line: str) -> list[str]:
    try:
        return next(csv.reader([line]), [])
    except csv.Error:
        return []


def _parse_lines(
    lines: Iterable[tuple[int, str | LineError]],
) -> Iterator[Entry | LineError]:
    for number, line in lines:
        if isinstance(line, LineError):
            yield line
            continue
        source = line.strip()
        if not source or source.startswith("#"):
            continue
        problem = _source_problem(source)
        yield LineError(number, problem) if problem else Entry(number, source, {}, None)


def _parse_csv(
    header_line: int, lines: Iterable[str | LineError]
) -> Iterator[Entry | LineError]:
    """Parse CSV from the header line on (file line = header_line + csv line - 1)."""
    pending: list[LineError] = []

    def physical() -> Iterator[str]:
        for line in lines:
            if isinstance(line, LineError):
                pending.append(line)
                yield ""
            else:
                yield line

    reader = csv.reader(physical())
    try:
        header = [cell.strip() for cell in next(reader)]
    except csv.Error as error:
        yield LineError(header_line, f"malformed CSV header: {error}")
        return
    # Column names become the params' keys, which PostgreSQL cannot store
    # with a NUL (psycopg refuses the whole batch with a DataError).
    if any("\x00" in name for name in header):
        yield LineError(header_line, "a column name in the header has a NUL character")
        return
    lowered = [h.lower() for h in header]
    duplicates = sorted({h for h in lowered if lowered.count(h) > 1})
    if duplicates:
        yield LineError(
            header_line, f"duplicate column(s) in the header: {', '.join(duplicates)}"
        )
        return
    if "" in lowered:
        yield LineError(header_line, "a column in the header has no name")
        return
    source_at = lowered.index("source")
    duration_at = (
        lowered.index("duration_seconds") if "duration_seconds" in lowered else None
    )
    while True:
        number = header_line + reader.line_num  # the line the next row starts on
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as error:
            yield from _drain(pending)
            yield LineError(number, f"malformed CSV: {error}")
            return
        yield from _drain(pending)
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            yield LineError(number, f"expected {len(header)} columns, found {len(row)}")
            continue
        yield _csv_entry(number, header, row, source_at, duration_at)


def _csv_entry(
    number: int,
    header: list[str],
    row: list[str],
    source_at: int,
    duration_at: int | None,
) -> Entry | LineError:
    source = row[source_at].strip()
    if problem := _source_problem(source):
        return LineError(number, problem)
    duration_ms = None
    if duration_at is not None and row[duration_at].strip():
        duration_ms, problem = _duration(row[duration_at])
        if problem:
            return LineError(number, problem)
    params = {}
    for at, name in enumerate(header):
        value = row[at].strip()
        if at in (source_at, duration_at) or not value:
            continue
        if "\x00" in value or len(value) > MAX_PARAM_CHARS:
            return LineError(
                number,
                f"column {name!r} has a NUL character or more than "
                f"{MAX_PARAM_CHARS} characters",
            )
        params[name] = value
    return Entry(number, source, params, duration_ms)


def _drain(errors: list[LineError]) -> Iterator[LineError]:
    while errors:
        yield errors.pop(0)


def _source_problem(source: str, *, sent: int = 0) -> str | None:
    """Why ``source`` cannot be handed to an engine, or None (``sent``: the
    length of the value as sent, before the spaces around it were stripped).

    Sources end up on engines' command lines and in logs and pages: control
    and format characters (Unicode Cc and Cf: bidi overrides spoof what an
    operator reads) and a leading ``-`` (an engine would take it for an option)
    are refused, and so is any URL scheme not in RECALL_SOURCE_SCHEMES.
    """
    if not source:
        return "the source is empty"
    if max(len(source), sent) > MAX_SOURCE_CHARS:
        return f"the source is longer than {MAX_SOURCE_CHARS} characters"
    for char in source:
        category = unicodedata.category(char)
        if category == "Cc":
            return "the source contains a control character"
        if category == "Cf":
            return (
                f"the source contains an invisible formatting character "
                f"(U+{ord(char):04X}; bidirectional overrides and zero-width "
                f"characters hide what a source really is)"
            )
    if source.startswith("-"):
        return (
            "the source starts with '-', which an engine would read as an option "
            "(write ./-name for a file whose name starts with '-')"
        )
    scheme = source_scheme(source)
    if scheme == "file" and (problem := _file_path_problem(source)):
        return problem
    allowed = settings.RECALL_SOURCE_SCHEMES
    if scheme is not None and scheme not in allowed:
        return (
            f"the scheme {scheme + ':'!r} is not allowed; use a plain path or one "
            f"of {', '.join(s + ':' for s in allowed)} (RECALL_SOURCE_SCHEMES)"
        )
    return None


def _file_path_problem(source: str) -> str | None:
    """Why the path of the ``file:`` URL ``source`` cannot reach an engine, or
    None. Workers hand engines the path with its %-escapes decoded (the
    reference worker's ``{source_path}``), so ``file:%2Drf`` arrives as
    ``-rf``: the checks on the source hold for the decoded path too."""
    path = urllib.parse.unquote(urllib.parse.urlsplit(source).path)
    if path.startswith("-"):
        return (
            f"the source's path starts with '-' once decoded ({path[:100]!r}), "
            f"which an engine would read as an option (write the whole path, "
            f"file:///dir/-name, for a file whose name starts with '-')"
        )
    if any(unicodedata.category(char) in ("Cc", "Cf") for char in path):
        return (
            "the source's path contains a control or invisible formatting "
            "character once decoded (%-escapes such as %00 or %0A)"
        )
    return None


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def source_scheme(source: str) -> str | None:
    """The URL scheme of ``source`` in lower case, or None for a plain path.

    A single letter before the colon is a Windows drive (``C:\\audio``), not a
    scheme.
    """
    match = _SCHEME.match(source)
    if match is None or len(match.group(1)) == 1:
        return None
    return match.group(1).lower()


def _duration(text: str) -> tuple[int | None, str | None]:
    try:
        seconds = float(text)
    except ValueError:
        return None, f"duration_seconds {text.strip()!r} is not a number"
    return _duration_ms(seconds, text.strip())


def _duration_ms(seconds: float, text: str) -> tuple[int | None, str | None]:
    """A duration in seconds (a float, or an integer of any size) as
    milliseconds, or why it cannot be one (``text``: the value as given)."""
    if not is_number(seconds) or seconds < 0:
        return (
            None,
            f"duration_seconds {text!r} must be a number of seconds, 0 or more",
        )
    # Compared before any conversion: float() overflows on a huge integer.
    if seconds > MAX_DURATION_SECONDS:
        return (None, f"duration_seconds {text!r} is more than {MAX_DURATION_SECONDS}")
    return round(seconds * 1000), None


def validate_manifest(lines: Iterable[bytes | str]) -> tuple[int, list[LineError], int]:
    """Count the entries and collect the first errors: (items, errors, total errors)."""
    items, total = 0, 0
    errors: list[LineError] = []
    limit = settings.RECALL_MAX_MANIFEST_ITEMS
    for parsed in parse_manifest(lines):
        if isinstance(parsed, LineError):
            total += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(parsed)
        else:
            items += 1
    if items > limit:
        total += 1
        errors.insert(
            0, LineError(0, f"the manifest has {items} items; the limit is {limit}")
        )
    if items == 0 and not total:
        total += 1
        errors.append(LineError(0, "the manifest has no sources"))
    return items, errors, total


def check_name(name: str) -> str:
    """The name without the spaces around it. Its length counts them (the
    operator API's schema limits the value sent)."""
    too_long = len(name) > MAX_NAME_CHARS
    name = name.strip()
    if not name:
        raise ManifestInvalid([LineError(0, "the batch needs a name")])
    if too_long or any(ord(c) < 32 for c in name):
        raise ManifestInvalid(
            [
                LineError(
                    0, f"the name must be at most {MAX_NAME_CHARS} printable characters"
                )
            ]
        )
    return name


def create_batch(
    name: str,
    open_manifest: Callable[[], Iterable[bytes | str]],
    *,
    priority: int = 0,
    weight: int = 1,
    max_in_flight: int | None = None,
    created_by=None,
    now=None,
    on_created: Callable[[Batch], None] | None = None,
    requires: Mapping[str, str] | None = None,
) -> Batch:
    """Validate the manifest, then create the batch, items, jobs and counters.

    ``open_manifest`` returns a fresh iterable of the manifest's lines each time
    it is called (the manifest is read twice). Raises ManifestInvalid, having
    created nothing, if any line is wrong. Everything is written in one
    transaction: a batch is never visible half-created. ``on_created(batch)``
    runs last inside that transaction, so what a caller records about the new
    batch (a background intake's outcome) commits with it or not at all.
    """
    name = check_name(name)
    items, errors, total_errors = validate_manifest(open_manifest())
    if errors:
        raise ManifestInvalid(errors, total_errors, items)
    return transitions.create_batch(
        name=name,
        items=_item_rows(parse_manifest(open_manifest())),
        priority=priority,
        weight=weight,
        max_in_flight=max_in_flight,
        created_by=created_by,
        now=now,
        on_created=on_created,
        requires=requires,
    )


def _item_rows(entries: Iterable[Entry | LineError]) -> Iterator[ItemRow]:
    """The validated manifest's items as the intake transition takes them."""
    for entry in entries:
        if isinstance(entry, LineError):  # the file changed since validation
            raise ManifestInvalid([entry])
        yield entry.source, entry.params, entry.duration_ms


# --- Items given as data (the operator API) ------------------------------------------

ITEM_FIELDS = frozenset({"source", "duration_seconds", "params"})
MAX_PARAM_NAME_CHARS = 200


@dataclass(frozen=True)
class ItemError:
    """What is wrong with ``items[index]`` (``index`` None: with the list)."""

    index: int | None
    message: str

    def __str__(self) -> str:
        return (
            self.message
            if self.index is None
            else f"items[{self.index}]: {self.message}"
        )


@dataclass
class ItemsInvalid(Exception):
    errors: list[ItemError]
    total_errors: int

    def __str__(self) -> str:
        return "; ".join(str(e) for e in self.errors)


def item_entry(index: int, item: object) -> Entry | ItemError:
    """One item of a submission (``{"source", "duration_seconds"?, "params"?}``)
    checked by the manifest's rules: the same sources, durations and params."""
    if not isinstance(item, dict):
        return ItemError(index, "an item must be an object with a 'source'")
    unknown = sorted(set(item) - ITEM_FIELDS)
    if unknown:
        return ItemError(
            index,
            f"unknown field(s) {', '.join(repr(u) for u in unknown)}; an item has "
            f"'source', 'duration_seconds' and 'params'",
        )
    source = item.get("source")
    if not isinstance(source, str):
        return ItemError(index, "'source' must be a string")
    sent, source = len(source), source.strip()
    # The schema's limit is on the value sent, spaces around it included.
    if problem := _source_problem(source, sent=sent):
        return ItemError(index, problem)
    duration_ms = None
    seconds = item.get("duration_seconds")
    if seconds is not None:
        if not is_number(seconds):
            return ItemError(index, "'duration_seconds' must be a number or null")
        duration_ms, problem = _duration_ms(seconds, shown(seconds))
        if problem:
            return ItemError(index, problem)
    params = item.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return ItemError(index, "'params' must be an object")
    for name, value in params.items():
        if not name or len(name) > MAX_PARAM_NAME_CHARS:
            return ItemError(
                index, f"a param's name must be 1 to {MAX_PARAM_NAME_CHARS} characters"
            )
        if isinstance(value, str):
            if len(value) > MAX_PARAM_CHARS:
                return ItemError(
                    index,
                    f"param {name!r} has more than {MAX_PARAM_CHARS} characters",
                )
        elif value is None or isinstance(value, dict | list):
            return ItemError(
                index, f"param {name!r} must be a string, a number or a boolean"
            )
    return Entry(index, source, params, duration_ms)


def validate_items(items: list) -> tuple[list[Entry], list[ItemError], int]:
    """Every item checked: (entries, the first errors, how many errors in all),
    with the manifest's limit on the number of items."""
    entries: list[Entry] = []
    errors: list[ItemError] = []
    total = 0
    limit = settings.RECALL_MAX_MANIFEST_ITEMS
    if len(items) > limit:
        return (
            [],
            [ItemError(None, f"there are {len(items)} items; the limit is {limit}")],
            1,
        )
    for index, item in enumerate(items):
        parsed = item_entry(index, item)
        if isinstance(parsed, ItemError):
            total += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(parsed)
        else:
            entries.append(parsed)
    if not items:
        total, errors = 1, [ItemError(None, "the batch has no items")]
    return entries, errors, total


def create_batch_from_items(
    name: str,
    items: list,
    *,
    priority: int = 0,
    weight: int = 1,
    max_in_flight: int | None = None,
    created_by=None,
    now=None,
    requires: Mapping[str, str] | None = None,
) -> Batch:
    """Like ``create_batch``, from items given as data. Raises ManifestInvalid
    (the name) or ItemsInvalid (every bad item, by index), having created
    nothing."""
    name = check_name(name)
    entries, errors, total = validate_items(items)
    if errors:
        raise ItemsInvalid(errors, total)
    return transitions.create_batch(
        name=name,
        items=((e.source, e.params, e.duration_ms) for e in entries),
        priority=priority,
        weight=weight,
        max_in_flight=max_in_flight,
        created_by=created_by,
        now=now,
        requires=requires,
    )


def file_lines(path: str) -> Callable[[], Iterator[bytes]]:
    """``open_manifest`` for a file on disk."""

    def lines() -> Iterator[bytes]:
        with open(path, "rb") as f:
            yield from f

    return lines
