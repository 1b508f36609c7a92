"""Operator actions, intake through the form, and exports."""

import csv
import io
import json
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches.models import Batch, BatchItem
from jobs import transitions
from jobs.models import Event, Job, Lease, LeaseEnd
from tests.support.clients import client_for, page_messages
from tests.support.factories import assert_consistent, claim, make_batch, make_worker

pytestmark = pytest.mark.django_db


def test_pause_and_resume(operator_client, operator, worker):
    batch = make_batch(2)

    response = operator_client.post(
        f"/batches/{batch.pk}/pause", {"return_query": "state=queued"}, follow=True
    )

    assert response.redirect_chain == [(f"/batches/{batch.pk}/?state=queued", 302)]
    assert page_messages(response) == [
        "Paused: no new work is handed out; leases in flight finish."
    ]
    batch.refresh_from_db()
    assert batch.paused_at is not None
    assert transitions.claim_next(worker, now=timezone.now()) is None
    assert Event.objects.get(kind=Event.Kind.BATCH_PAUSED).actor == operator
    assert "Resume</button>" in response.content.decode()

    response = operator_client.post(f"/batches/{batch.pk}/resume", follow=True)

    assert page_messages(response) == ["Resumed."]
    assert Batch.objects.get(pk=batch.pk).paused_at is None
    assert claim(worker, now=timezone.now()).batch_id == batch.pk
    assert (
        Event.objects.filter(kind=Event.Kind.BATCH_RESUMED, actor=operator).count() == 1
    )


def test_cancel_ends_queued_and_in_flight_items_atomically(
    operator_client, operator, worker
):
    batch = make_batch(4)
    done = claim(worker, now=timezone.now())
    transitions.complete(done, done.lease_token, worker=worker, result={"text": "kept"})
    in_flight = claim(worker, now=timezone.now())

    response = operator_client.post(f"/batches/{batch.pk}/cancel", follow=True)

    assert page_messages(response) == [
        "Cancelled: 3 queued or in-flight item(s) cancelled. Finished items keep their results."
    ]
    counts = Batch.objects.get(pk=batch.pk).counts()
    assert (
        counts["cancelled"],
        counts["done"],
        counts["queued"],
        counts["transcribing"],
    ) == (3, 1, 0, 0)
    assert Lease.objects.get(job=in_flight).end_reason == LeaseEnd.FORCED
    assert Job.objects.get(pk=done.pk).result == {"text": "kept"}
    assert Event.objects.get(kind=Event.Kind.BATCH_CANCELLED).actor == operator
    assert Batch.objects.get(pk=batch.pk).finished_at is not None
    assert_consistent(timezone.now())
    # The worker holding the cancelled lease is told to stop.
    from jobs.exceptions import LeaseLost

    with pytest.raises(LeaseLost):
        transitions.heartbeat(in_flight, in_flight.lease_token, worker=worker)


def test_retry_all_failed_or_those_matching_the_search(
    operator_client, worker, settings
):
    batch = make_batch(6)
    for _ in range(4):
        job = claim(worker, now=timezone.now())
        transitions.fail(
            job, job.lease_token, worker=worker, error="x", retryable=False
        )

    response = operator_client.post(
        f"/batches/{batch.pk}/retry", {"q": "batch-1"}, follow=True
    )

    assert page_messages(response) == [
        "Queued 1 failed item(s) matching “batch-1” again, with fresh attempts."
    ]
    assert batch.counts()["failed"] == 3

    response = operator_client.post(f"/batches/{batch.pk}/retry", follow=True)

    assert page_messages(response) == [
        "Queued 3 failed item(s) again, with fresh attempts."
    ]
    assert batch.counts()["failed"] == 0
    assert set(Job.objects.filter(batch=batch).values_list("attempts", flat=True)) == {
        0
    }
    assert_consistent(timezone.now())


def test_cancelled_batch_cannot_be_retried(operator_client, worker):
    batch = make_batch(2)
    job = claim(worker, now=timezone.now())
    transitions.fail(job, job.lease_token, worker=worker, error="x", retryable=False)
    operator_client.post(f"/batches/{batch.pk}/cancel")

    response = operator_client.post(f"/batches/{batch.pk}/retry", follow=True)

    assert page_messages(response)[-1] == "A cancelled batch cannot be retried."
    assert batch.counts()["failed"] == 1


# --- New batch ---------------------------------------------------------------------------


def test_upload_a_csv_manifest(operator_client, operator):
    manifest = SimpleUploadedFile(
        "m.csv", b"source,duration_seconds,lang\n/a.wav,12,en\n/b.wav,3.5,de\n"
    )

    response = operator_client.post(
        "/batches/new/", {"name": "Upload", "priority": 2, "manifest": manifest}
    )

    batch = Batch.objects.get()
    assert response.status_code == 302
    assert response["Location"] == f"/batches/{batch.pk}/"
    assert (
        batch.name,
        batch.priority,
        batch.total,
        batch.total_ms,
        batch.created_by,
    ) == ("Upload", 2, 2, 15500, operator)
    assert list(BatchItem.objects.order_by("pk").values_list("source", "params")) == [
        ("/a.wav", {"lang": "en"}),
        ("/b.wav", {"lang": "de"}),
    ]


def test_paste_sources(operator_client):
    response = operator_client.post(
        "/batches/new/",
        {"name": "Pasted", "priority": 0, "sources": "/a.wav\n\n/b.wav\r\n"},
    )

    assert response.status_code == 302
    assert list(BatchItem.objects.values_list("source", flat=True).order_by("pk")) == [
        "/a.wav",
        "/b.wav",
    ]


def test_every_bad_line_is_shown_and_nothing_is_created(operator_client):
    manifest = SimpleUploadedFile(
        "m.csv", b"source,duration_seconds\n/a.wav,abc\n,3\n/ok.wav,4\n"
    )

    response = operator_client.post(
        "/batches/new/", {"name": "Bad", "priority": 0, "manifest": manifest}
    )

    page = response.content.decode()
    assert response.status_code == 400
    assert "The manifest has 2 problem(s); nothing was created." in page
    assert (
        "<strong>Line 2:</strong> duration_seconds &#x27;abc&#x27; is not a number"
        in page
    )
    assert "<strong>Line 3:</strong> the source is empty" in page
    assert not Batch.objects.exists()
    assert not BatchItem.objects.exists()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "priority": 0}, "Upload a manifest file or paste sources."),
        (
            {
                "name": "x",
                "priority": 0,
                "sources": "/a",
                "manifest": SimpleUploadedFile("m.txt", b"/b\n"),
            },
            "Upload a file or paste sources, not both.",
        ),
        ({"name": "", "priority": 0, "sources": "/a"}, "This field is required."),
        (
            {"name": "x", "priority": 99999, "sources": "/a"},
            "Ensure this value is less than or equal to 32767.",
        ),
        (
            {"name": "x", "priority": 0, "sources": "# only a comment"},
            "the manifest has no sources",
        ),
    ],
)
def test_form_errors(operator_client, data, message):
    response = operator_client.post("/batches/new/", data)

    assert response.status_code == 400
    assert message in response.content.decode()
    assert not Batch.objects.exists()


def test_the_file_size_limit_is_enforced_with_a_clear_message(
    operator_client, settings
):
    settings.RECALL_MAX_MANIFEST_BYTES = 1000
    manifest = SimpleUploadedFile("m.txt", b"/audio/file.wav\n" * 100)

    response = operator_client.post(
        "/batches/new/", {"name": "big", "priority": 0, "manifest": manifest}
    )

    assert response.status_code == 400
    assert (
        "The file is 1.6\xa0KB; the limit is 1000\xa0bytes."
        in response.content.decode()
    )
    assert not Batch.objects.exists()


def test_pasting_more_than_the_body_limit_is_a_form_error(operator_client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000

    response = operator_client.post(
        "/batches/new/", {"name": "big", "priority": 0, "sources": "/a.wav\n" * 500}
    )

    assert response.status_code == 413
    assert (
        "The pasted text is larger than 1000\xa0bytes; upload it as a file instead."
        in response.content.decode()
    )
    assert not Batch.objects.exists()


# --- Exports ------------------------------------------------------------------------------


@pytest.fixture
def exported(worker):
    batch = make_batch(3)
    job = claim(worker, now=timezone.now())
    transitions.complete(
        job,
        job.lease_token,
        worker=worker,
        result={
            "text": 'hello, "world"\nbye',
            "segments": [
                {"start": 0, "end": 1.25, "text": "hello"},
                {"start": 3661.5, "end": 3662, "text": "bye"},
            ],
        },
    )
    job = claim(worker, now=timezone.now())
    transitions.fail(
        job, job.lease_token, worker=worker, error="no audio", retryable=False
    )
    return batch


def _body(response) -> bytes:
    assert response.streaming
    return b"".join(response.streaming_content)


def test_csv_export(operator_client, exported):
    response = operator_client.get(f"/batches/{exported.pk}/export.csv")

    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert (
        response["Content-Disposition"]
        == f'attachment; filename="batch-{exported.pk}-items.csv"'
    )
    rows = list(csv.reader(io.StringIO(_body(response).decode())))
    items = list(
        BatchItem.objects.filter(batch=exported)
        .order_by("pk")
        .values_list("pk", "source")
    )
    # The last column, the item's quality flags, was added by issue 29.
    assert rows == [
        ["item", "source", "state", "attempts", "text", "error", "flags"],
        [str(items[0][0]), items[0][1], "done", "1", 'hello, "world"\nbye', "", ""],
        [str(items[1][0]), items[1][1], "failed", "1", "", "no audio", ""],
        [str(items[2][0]), items[2][1], "queued", "0", "", "", ""],
    ]


def test_jsonl_export(operator_client, exported):
    lines = (
        _body(operator_client.get(f"/batches/{exported.pk}/export.jsonl"))
        .decode()
        .splitlines()
    )

    records = [json.loads(line) for line in lines]
    assert [(r["state"], r["attempts"], r["text"], r["error"]) for r in records] == [
        ("done", 1, 'hello, "world"\nbye', ""),
        ("failed", 1, "", "no audio"),
        ("queued", 0, "", ""),
    ]


def test_zip_export_has_txt_and_srt(operator_client, exported):
    item = BatchItem.objects.filter(batch=exported).order_by("pk").first()

    archive = zipfile.ZipFile(
        io.BytesIO(_body(operator_client.get(f"/batches/{exported.pk}/export.zip")))
    )

    stem = f"{item.pk:08d}-batch-0"
    assert archive.namelist() == [f"{stem}.txt", f"{stem}.srt"]
    assert archive.read(f"{stem}.txt").decode() == 'hello, "world"\nbye\n'
    assert archive.read(f"{stem}.srt").decode() == (
        "1\n00:00:00,000 --> 00:00:01,250\nhello\n\n2\n01:01:01,500 --> 01:01:02,000\nbye\n"
    )


def test_exports_read_in_chunks(
    operator_client, worker, monkeypatch, django_assert_max_num_queries
):
    monkeypatch.setattr("batches.exports.CHUNK", 10)
    batch = make_batch(35)

    with django_assert_max_num_queries(12):
        lines = (
            _body(operator_client.get(f"/batches/{batch.pk}/export.csv"))
            .decode()
            .splitlines()
        )

    assert len(lines) == 36


def test_the_new_batch_form_needs_a_csrf_token(operator):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)

    response = client.post(
        "/batches/new/", {"name": "x", "priority": 0, "sources": "/a"}
    )

    assert response.status_code == 403
    assert not Batch.objects.exists()


def test_an_oversized_paste_gets_a_clear_answer_even_with_csrf_checks(
    operator, settings
):
    from django.test import Client

    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    client.get("/batches/new/")  # as a browser would: this sets the CSRF cookie

    response = client.post(
        "/batches/new/", {"name": "x", "priority": 0, "sources": "/a.wav\n" * 500}
    )

    assert response.status_code == 413
    assert "upload it as a file instead" in response.content.decode()
    assert not Batch.objects.exists()


def test_a_cancel_cut_short_by_its_time_limit_is_finished_by_reconciliation(
    operator, monkeypatch, settings
):
    from engine.reconcile import reconcile

    settings.RECALL_CHUNK_SIZE = 5
    monkeypatch.setattr(
        "console.views.batches.ACTION_SECONDS", 0
    )  # no time for any chunk
    batch = make_batch(12)
    client = client_for(operator)

    response = client.post(f"/batches/{batch.pk}/cancel", follow=True)

    assert page_messages(response) == [
        "Cancelled: 0 queued or in-flight item(s) cancelled. Finished items keep their "
        "results. The other 12 are being cancelled in the background."
    ]
    assert transitions.claim_next(make_worker("late"), now=timezone.now()) is None
    assert reconcile(now=timezone.now()).cancels_finished == 12
    assert batch.counts()["cancelled"] == 12
    assert_consistent(timezone.now())


def test_an_operator_changes_the_share_and_it_is_an_event(operator_client, operator):
    batch = make_batch(3)

    response = operator_client.post(
        f"/batches/{batch.pk}/share",
        {"priority": 2, "weight": 3, "max_in_flight": 4, "return_query": "q=a"},
        follow=True,
    )

    assert response.redirect_chain == [(f"/batches/{batch.pk}/?q=a", 302)]
    assert page_messages(response) == [
        "Changed priority 0 -> 2, weight 1 -> 3, max in flight unlimited -> 4; the "
        "next claim follows it."
    ]
    batch.refresh_from_db()
    assert (batch.priority, batch.weight, batch.max_in_flight) == (2, 3, 4)
    event = Event.objects.get(kind=Event.Kind.BATCH_CHANGED)
    assert (event.actor, event.batch_id) == (operator, batch.pk)
    page = response.content.decode()
    assert "priority 2 · weight 3 · max in flight 4" in page
    assert "0 of 0 leases, weight 3, at most 4 in flight" in page

    response = operator_client.post(
        f"/batches/{batch.pk}/share",
        {"priority": 2, "weight": 3, "max_in_flight": ""},
        follow=True,
    )
    assert "max in flight 4 -&gt; unlimited" in response.content.decode()
    assert Batch.objects.get(pk=batch.pk).max_in_flight is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"priority": 0, "weight": 0},
            "Nothing was changed. Weight: Ensure this value is greater than or "
            "equal to 1.",
        ),
        (
            {"priority": 0, "weight": 1001},
            "Nothing was changed. Weight: Ensure this value is less than or equal "
            "to 1000.",
        ),
        (
            {"priority": 0, "weight": 2, "max_in_flight": "-3"},
            "Nothing was changed. Max in flight: Ensure this value is greater "
            "than or equal to 1.",
        ),
        (
            {"priority": "x", "weight": 2},
            "Nothing was changed. Priority: Enter a whole number.",
        ),
    ],
)
def test_a_bad_share_changes_nothing(operator_client, data, message):
    batch = make_batch(2)

    response = operator_client.post(f"/batches/{batch.pk}/share", data, follow=True)

    assert page_messages(response) == [message]
    batch.refresh_from_db()
    assert (batch.priority, batch.weight, batch.max_in_flight) == (0, 1, None)
    assert not Event.objects.filter(kind=Event.Kind.BATCH_CHANGED).exists()


def test_a_viewer_cannot_change_the_share(viewer_client):
    batch = make_batch(2)

    response = viewer_client.post(
        f"/batches/{batch.pk}/share", {"priority": 1, "weight": 5}
    )

    assert response.status_code == 403
    assert Batch.objects.get(pk=batch.pk).weight == 1


def test_the_new_batch_form_takes_weight_and_max_in_flight(operator_client):
    response = operator_client.post(
        "/batches/new/",
        {
            "name": "Shared",
            "priority": 1,
            "weight": 5,
            "max_in_flight": 2,
            "sources": "/a",
        },
    )

    assert response.status_code == 302
    batch = Batch.objects.get(name="Shared")
    assert (batch.priority, batch.weight, batch.max_in_flight) == (1, 5, 2)


def test_progress_json_has_weight_cap_and_in_flight(operator_client, worker):
    batch = make_batch(4)
    transitions.set_share(batch, priority=0, weight=7, max_in_flight=None)
    claim(worker, now=timezone.now())

    body = operator_client.get(f"/batches/{batch.pk}/progress.json").json()

    assert (body["weight"], body["max_in_flight"], body["in_flight"]) == (7, None, 1)
    assert body["counts"]["transcribing"] == 1
