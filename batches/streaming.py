"""Exports as streamed HTTP responses, for the operator UI and the operator API.

A process streams at most RECALL_EXPORTS_PER_PROCESS exports at once, whichever
door asked for them, so its other threads stay free for the worker API.
"""

from __future__ import annotations

import threading

from django.conf import settings
from django.http import StreamingHttpResponse

from . import exports
from .models import Batch

EXPORTS = {
    "csv": ("text/csv; charset=utf-8", exports.csv_lines),
    "jsonl": ("application/x-ndjson; charset=utf-8", exports.jsonl_lines),
    "zip": ("application/zip", exports.transcripts_zip),
}


class ExportSlots:
    """How many exports this process streams at once: at most
    RECALL_EXPORTS_PER_PROCESS, so its other threads stay free for the worker
    API whatever operators export (a million items stream for about a minute)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_use = 0

    def take(self) -> bool:
        limit = settings.RECALL_EXPORTS_PER_PROCESS
        with self._lock:
            if limit and self.in_use >= limit:
                return False
            self.in_use += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.in_use -= 1


EXPORT_SLOTS = ExportSlots()


class _Streaming:
    """An export's chunks; its slot is given back once, when the response is
    closed (the server closes it at the end, and when the client goes away)."""

    def __init__(self, chunks, slots: ExportSlots):
        self.chunks, self.slots, self.open = chunks, slots, True

    def __iter__(self):
        return iter(self.chunks)

    def close(self) -> None:
        if self.open:
            self.open = False
            close = getattr(self.chunks, "close", None)
            if close is not None:
                close()
            self.slots.give_back()


def export_response(batch: Batch, fmt: str) -> StreamingHttpResponse | None:
    """The batch's export in ``fmt`` (a key of EXPORTS), streamed as a download;
    None when this process already streams as many exports as it may."""
    content_type, generate = EXPORTS[fmt]
    name = f"batch-{batch.pk}-{'transcripts' if fmt == 'zip' else 'items'}.{fmt}"
    if not EXPORT_SLOTS.take():
        return None
    try:
        chunks = _Streaming(generate(batch), EXPORT_SLOTS)
    except BaseException:
        EXPORT_SLOTS.give_back()
        raise
    response = StreamingHttpResponse(chunks, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    response["Cache-Control"] = "no-store"
    return response
