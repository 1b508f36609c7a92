"""Batch exports: CSV, JSON Lines and a ZIP of transcripts, all streamed.

Rows are read in keyset-paginated chunks (``id > last``, in id order), so an
export of a million items holds one chunk in memory, never the batch.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeGuard

from django.db.models.fields.json import KeyTextTransform

from .flags import FLAG_COLUMNS
from .models import Batch, BatchItem, ItemStatus
from .numbers import is_number
from .zipstream import stream_zip

CHUNK = 2_000
# The worker API's bound on segment times (api.worker_views): about 115 days.
MAX_SEGMENT_SECONDS = 10_000_000
EXPORT_FIELDS = ("item", "source", "state", "attempts", "text", "error", "flags")


@dataclass(frozen=True)
class Row:
    item: int
    source: str
    state: str
    attempts: int
    text: str
    error: str
    flags: list[str]


def export_rows(batch: Batch) -> Iterator[Row]:
    """One row per item, in item order; ``text`` is the transcript ("" if none),
    ``flags`` its quality flags (``batches.flags``), sorted."""
    last = 0
    while True:
        chunk = list(
            BatchItem.objects.filter(batch=batch, pk__gt=last)
            .order_by("pk")
            .annotate(text=KeyTextTransform("text", "job__result"))
            .values_list(
                "pk",
                "source",
                "status",
                "job__attempts",
                "text",
                "job__last_error",
                *FLAG_COLUMNS.values(),
            )[:CHUNK]
        )
        for pk, source, status, attempts, text, error, *flagged in chunk:
            flags = sorted(f for f, on in zip(FLAG_COLUMNS, flagged, strict=True) if on)
            yield Row(pk, source, status, attempts or 0, text or "", error or "", flags)
        if len(chunk) < CHUNK:
            return
        last = chunk[-1][0]


class _Line:
    """A file-like object that hands back what csv.writer writes."""

    def write(self, value: str) -> str:
        return value


# A cell starting with one of these is a formula to Excel and LibreOffice
# (``=HYPERLINK(...)`` can leak data): OWASP's advice is a leading apostrophe.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(value: object) -> object:
    """A CSV cell a spreadsheet shows as text, never runs: strings that would
    start a formula get a leading ``'``; numbers and other strings are unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def csv_writer() -> Callable[[Iterable[object]], str]:
    """``write(row)`` returns one CSV line; every cell is spreadsheet-safe.

    Every CSV Recall writes goes through this, so no cell can become a formula.
    """
    writer = csv.writer(_Line())

    def write(row: Iterable[object]) -> str:
        return writer.writerow([spreadsheet_safe(cell) for cell in row])

    return write


def csv_lines(batch: Batch) -> Iterator[str]:
    write = csv_writer()
    yield write(EXPORT_FIELDS)
    for row in export_rows(batch):
        yield write(
            (
                row.item,
                row.source,
                row.state,
                row.attempts,
                row.text,
                row.error,
                " ".join(row.flags),  # space-separated names, "" when none
            )
        )


def jsonl_lines(batch: Batch) -> Iterator[str]:
    for row in export_rows(batch):
        yield (
            json.dumps(
                {
                    "item": row.item,
                    "source": row.source,
                    "state": row.state,
                    "attempts": row.attempts,
                    "text": row.text,
                    "error": row.error,
                    "flags": row.flags,
                },
                ensure_ascii=False,
            )
            + "\n"
        )


def transcripts_zip(batch: Batch) -> Iterator[bytes]:
    """A .txt per transcribed item, and a .srt where the result has segments."""
    return stream_zip(_transcript_files(batch))


def _transcript_files(batch: Batch) -> Iterator[tuple[str, bytes]]:
    last = 0
    while True:
        chunk = list(
            BatchItem.objects.filter(batch=batch, pk__gt=last, status=ItemStatus.DONE)
            .order_by("pk")
            .values_list("pk", "source", "job__result")[:CHUNK]
        )
        for pk, source, result in chunk:
            result = result or {}
            stem = f"{pk:08d}-{_safe_stem(source)}"
            # Stored results are read as they are: rows written before the API
            # checked them as closely may hold anything JSON can.
            result = result if isinstance(result, dict) else {}
            text = result.get("text")
            yield f"{stem}.txt", (_text(text) + "\n").encode()
            if subtitles := srt(result.get("segments")):
                yield f"{stem}.srt", subtitles.encode()
        if len(chunk) < CHUNK:
            return
        last = chunk[-1][0]


def _safe_stem(source: str) -> str:
    name = re.split(r"[/\\]", source.rstrip("/\\"))[-1] or "item"
    name = name.rsplit(".", 1)[0] if "." in name[1:] else name
    return (re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "item")[:80]


def srt(segments: object) -> str:
    """SubRip subtitles from timed segments ({"start", "end", "text"} in seconds).

    Never raises: a segment without usable times (not a number, not finite, out
    of 0 <= start <= end <= MAX_SEGMENT_SECONDS) is left out, and no usable
    segment at all gives "" (no .srt).
    """
    if not isinstance(segments, list):
        return ""
    blocks: list[str] = []
    for segment in segments:
        if not isinstance(segment, dict):
            continue
        start, end = segment.get("start"), segment.get("end")
        if not (_seconds(start) and _seconds(end) and start <= end):
            continue
        text = _text(segment.get("text")).strip()
        n = len(blocks) + 1
        blocks.append(f"{n}\n{_srt_time(start)} --> {_srt_time(end)}\n{text}\n")
    return "\n".join(blocks)


def _seconds(value: object) -> TypeGuard[int | float]:
    # is_number, not math.isfinite: that overflows on an integer past 1e308.
    return is_number(value) and 0 <= value <= MAX_SEGMENT_SECONDS


def _text(value: object) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _srt_time(seconds: float) -> str:
    ms = round(float(seconds) * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d},{ms:03d}"
