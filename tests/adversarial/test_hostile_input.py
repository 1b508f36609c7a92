"""Hostile input through every door (issue 24, items 4 to 8): sources that reach
an engine as options once decoded, JSON nested past every recursion limit,
integers past every float, digits ``int`` refuses, a NUL in a CSV header.
Each answers a clear 4xx or a form error, creates nothing, and no stored row of
any shape breaks a page, an export or an API read afterwards.

The stored rows are written with SQL, bypassing the API, as rows kept from
before these checks (or written by hand) would be.
"""

from __future__ import annotations

import io
import json
import zipfile
from urllib.parse import urlencode

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client

from batches import background
from batches.intakes import Intake
from batches.models import Batch, BatchItem
from batches.numbers import whole_number
from batches.tasks import run_intake
from operator_api import tokens

from ..factories import (
    T0,
    is_postgres,
    jobs_of,
    make_batch,
    make_user,
)

pytestmark = pytest.mark.django_db


# --- Helpers --------------------------------------------------------------------------

BIG = "1" + "0" * 400  # 1e400 as an integer: no float holds it
HUGE = "9" * 5000  # past Python's 4,300-digit conversion limit


@pytest.fixture
def superuser():
    return make_user("root-admin", superuser=True)


@pytest.fixture
def site(superuser) -> Client:
    """The operator UI and the admin, as a superuser sees them."""
    client = Client()
    client.force_login(superuser)
    return client


class OperatorApi:
    """The operator API with a superuser's token."""

    def __init__(self, user):
        _, token = tokens.issue_token(user, label="hostile", now=T0)
        self.client = Client()
        self.auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}

    def get(self, path: str):
        return self.client.get(path, **self.auth)

    def post(self, path: str, raw: str | bytes):
        return self.client.post(
            path, data=raw, content_type="application/json", **self.auth
        )


@pytest.fixture
def operator_api(superuser) -> OperatorApi:
    return OperatorApi(superuser)


def nested(levels: int, inner: str = "") -> str:
    """JSON text: ``inner`` inside ``levels`` arrays."""
    return "[" * levels + inner + "]" * levels


def store(model, column: str, pk: int, text: str) -> None:
    """Write JSON text into a JSON column with SQL, as an old row would hold it."""
    cast = "::jsonb" if is_postgres() else ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {model._meta.db_table} SET {column} = %s{cast} WHERE id = %s",
            [text, pk],
        )


def error_of(response) -> dict:
    assert response["Content-Type"] == "application/json", response.content[:300]
    return json.loads(response.content)


def consumed(response) -> bytes:
    """A response's whole body, streamed or not."""
    if response.streaming:
        return b"".join(response.streaming_content)
    return response.content


def unpacked(response) -> bytes:
    """An export's content: a ZIP's files joined, or the body itself."""
    body = consumed(response)
    if response["Content-Type"] != "application/zip":
        return body
    archive = zipfile.ZipFile(io.BytesIO(body))
    return b"".join(archive.read(name) for name in archive.namelist())


def nothing_created() -> bool:
    return not Batch.objects.exists() and not BatchItem.objects.exists()


def upload(data: bytes) -> SimpleUploadedFile:
    return SimpleUploadedFile("manifest.csv", data, content_type="text/csv")


def refusals_everywhere(site, operator_api, tmp_path, manifest: bytes) -> dict:
    """Submit ``manifest`` through the web form, the create_batch command and
    the background intake: what each said."""
    form = site.post(
        "/batches/new/", {"name": "n", "priority": 0, "manifest": upload(manifest)}
    )
    path = tmp_path / "manifest.csv"
    path.write_bytes(manifest)
    with pytest.raises(CommandError) as command:
        call_command("create_batch", "n", str(path))
    intake = background.start_intake("n", upload(manifest))
    outcome = run_intake(intake.pk)
    intake = Intake.objects.get(pk=intake.pk)
    return {
        "form": (form.status_code, form.content.decode()),
        "command": str(command.value),
        "background": (outcome, intake.errors),
    }


# --- 7. Digits that isdigit() accepts and int() refuses ----------------------------


def fullwidth(number: int) -> str:
    return str(number).translate({ord(d): 0xFF10 + int(d) for d in "0123456789"})


def test_7_query_numbers_must_be_ascii_digits_of_a_sane_length(site, operator_api):
    batch = make_batch(3)
    first = jobs_of(batch)[0]
    every = [job.item_id for job in jobs_of(batch)]

    def listed(**query: str) -> list[int]:
        response = site.get(f"/batches/{batch.pk}/?{urlencode(query)}")
        assert response.status_code == 200, query
        return [item.pk for item in response.context["page"].object_list]

    for value in ("²", "¹²", fullwidth(first.item_id), HUGE, "-1", " 1", ""):
        # Not a cursor: the first page, as without one.
        assert listed(after=value) == every, value
        assert listed(before=value) == every, value
        live = site.get(f"/batches/{batch.pk}/items/live?{urlencode({'after': value})}")
        assert live.status_code in (200, 286)
    assert listed(after=str(first.item_id)) == every[1:]
    for name, value in (
        ("attempts", "²"),
        ("attempts", "²+"),
        ("attempts", HUGE),
        ("attempts", HUGE + "+"),
        ("q", HUGE),
        ("batch__id__exact", HUGE),
        ("batch__id__exact", fullwidth(batch.pk)),
    ):
        query = urlencode({name: value})
        assert site.get(f"/admin/jobs/job/?{query}").status_code == 200, query
    for url in (
        "/admin/batches/batchitem/",
        "/admin/batches/batch/",
        "/admin/jobs/event/",
        "/admin/jobs/webhookevent/",
    ):
        for value in (HUGE, "²"):
            assert site.get(f"{url}?{urlencode({'q': value})}").status_code == 200
    for name, value, detail in (
        ("cursor", "²", "'cursor' must be a next_cursor this API returned."),
        ("cursor", HUGE, "'cursor' must be a next_cursor this API returned."),
        ("limit", "²", "'limit' must be a whole number from 1 to 100."),
        ("limit", HUGE, "'limit' must be a whole number from 1 to 100."),
        ("limit", "１", "'limit' must be a whole number from 1 to 100."),
    ):
        for path in ("/api/v1/batches", f"/api/v1/batches/{batch.pk}/items"):
            response = operator_api.get(f"{path}?{urlencode({name: value})}")
            assert response.status_code == 400, (path, name, value)
            assert error_of(response)["detail"] == detail


def test_7_whole_numbers_are_ascii_digits_only():
    assert whole_number("0") == 0
    assert whole_number("0042") == 42
    assert whole_number("9223372036854775807") == 2**63 - 1
    assert whole_number(HUGE) == 2**63  # capped, never converted
    assert whole_number("0" * 5000 + "7") == 7
    assert whole_number("12", cap=10) == 10
    for text in ("", "²", "１", "٣", "-1", "+1", " 1", "1 ", "1.0", "1e3", "0x1"):
        assert whole_number(text) is None, text
