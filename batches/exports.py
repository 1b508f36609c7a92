"""Batch exports: CSV, JSON Lines and a ZIP of transcripts, all streamed.

Rows are read in keyset-paginated chunks (``id > last``, in id order), so an
export of a million items holds one chunk in memory, never the batch.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

from django.db.models.fields.json import KeyTextTransform

from .models import Batch, BatchItem, ItemStatus
from .zipstream import stream_zip

CHUNK = 2_000
EXPORT_FIELDS = ("item", "source", "state", "attempts", "text", "error")


@dataclass(frozen=True)
class Row:
    item: int
    source: str
    state: str
    attempts: int
    text: str
    error: str


def export_rows(batch: Batch) -> Iterator[Row]:
    """One row per item, in item order; ``text`` is the transcript ("" if none)."""
    last = 0
    while True:
        chunk = list(
            BatchItem.objects.filter(batch=batch, pk__gt=last)
            .order_by("pk")
            .annotate(text=KeyTextTransform("text", "job__result"))
            .values_list(
                "pk", "source", "status", "job__attempts", "text", "job__last_error"
            )[:CHUNK]
        )
        for pk, source, status, attempts, text, error in chunk:
            yield Row(pk, source, status, attempts or 0, text or "", error or "")
        if len(chunk) < CHUNK:
            return
        last = chunk[-1][0]


class _Line:
    """A file-like object that hands back what csv.writer writes."""

    def write(self, value: str) -> str:
        return value


def csv_lines(batch: Batch) -> Iterator[str]:
    writer = csv.writer(_Line())
    yield writer.writerow(EXPORT_FIELDS)
    for row in export_rows(batch):
        yield writer.writerow(
            (row.item, row.source, row.state, row.attempts, row.text, row.error)
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
            yield f"{stem}.txt", (result.get("text", "") + "\n").encode()
            if segments := result.get("segments"):
                yield f"{stem}.srt", srt(segments).encode()
        if len(chunk) < CHUNK:
            return
        last = chunk[-1][0]


def _safe_stem(source: str) -> str:
    name = re.split(r"[/\\]", source.rstrip("/\\"))[-1] or "item"
    name = name.rsplit(".", 1)[0] if "." in name[1:] else name
    return (re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "item")[:80]


def srt(segments: list[dict]) -> str:
    """SubRip subtitles from timed segments ({"start", "end", "text"} in seconds)."""
    blocks = []
    for n, segment in enumerate(segments, 1):
        text = str(segment.get("text", "")).strip()
        start, end = _srt_time(segment["start"]), _srt_time(segment["end"])
        blocks.append(f"{n}\n{start} --> {end}\n{text}\n")
    return "\n".join(blocks)


def _srt_time(seconds: float) -> str:
    ms = round(float(seconds) * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d},{ms:03d}"
