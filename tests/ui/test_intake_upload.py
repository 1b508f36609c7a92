"""The new-batch form with large manifests: refused while they arrive when over
RECALL_MAX_MANIFEST_BYTES, and taken in by the cluster in the background (with
a progress page, then the batch) when over RECALL_BACKGROUND_INTAKE_BYTES."""

import select
import socket
import time
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches.intake_records import Intake, IntakePhase, IntakeStatus
from batches.models import Batch
from engine import background_intake as background
from engine.tasks import run_intake
from tests.support.factories import make_user

pytestmark = pytest.mark.django_db


def manifest(n: int) -> bytes:
    return "".join(f"s3://audio/{i:06d}.flac\n" for i in range(n)).encode()


def post_file(client, data: bytes, name: str = "Big"):
    return client.post(
        "/batches/new/",
        {
            "name": name,
            "priority": 0,
            "manifest": SimpleUploadedFile("m.txt", data, content_type="text/plain"),
        },
    )


def test_a_file_over_the_limit_is_refused_with_413_and_nothing_created(
    operator_client, settings
):
    settings.RECALL_MAX_MANIFEST_BYTES = 1000

    response = post_file(operator_client, manifest(5000))  # 115 kB: two chunks on

    assert response.status_code == 413
    assert (
        "The file is larger than 1000\xa0bytes, the limit; Recall stopped reading it "
        "and created nothing." in response.content.decode()
    )
    assert not Batch.objects.exists()
    assert not Intake.objects.exists()


def test_a_file_at_the_limit_is_accepted(operator_client, settings):
    data = manifest(40)
    settings.RECALL_MAX_MANIFEST_BYTES = len(data)

    response = post_file(operator_client, data)

    assert response.status_code == 302
    assert Batch.objects.get().total == 40


def test_a_large_file_is_taken_in_in_the_background(
    operator_client, settings, django_capture_on_commit_callbacks
):
    settings.RECALL_BACKGROUND_INTAKE_BYTES = 1000
    data = manifest(300)

    with django_capture_on_commit_callbacks(execute=True):
        response = post_file(operator_client, data, name="Night calls")

    intake = Intake.objects.get()
    assert response.status_code == 302
    assert response["Location"] == f"/intakes/{intake.pk}/"
    assert not Batch.objects.exists()  # not yet: the cluster's job
    waiting = operator_client.get(f"/intakes/{intake.pk}/")
    assert waiting.status_code == 200
    page = waiting.content.decode()
    assert "Stored; waiting for the django-q2 cluster to take it in." in page
    assert '<meta http-equiv="refresh" content="2">' in page

    run_intake(intake.pk)  # what the cluster does with the queued task

    done = operator_client.get(f"/intakes/{intake.pk}/", follow=True)
    batch = Batch.objects.get()
    assert done.redirect_chain == [(f"/batches/{batch.pk}/", 302)]
    assert (batch.name, batch.total) == ("Night calls", 300)
    assert "<h1>Night calls</h1>" in done.content.decode()


def test_small_files_are_still_taken_in_within_the_request(operator_client, settings):
    settings.RECALL_BACKGROUND_INTAKE_BYTES = 10_000

    response = post_file(operator_client, manifest(100))

    batch = Batch.objects.get()
    assert response["Location"] == f"/batches/{batch.pk}/"
    assert not Intake.objects.exists()


@pytest.fixture
def intake(operator):
    upload = SimpleUploadedFile("m.txt", manifest(1000))
    return background.start_intake("Night calls", upload, created_by=operator)


def test_the_progress_page_while_checking(viewer_client, intake):
    Intake.objects.filter(pk=intake.pk).update(
        status=IntakeStatus.RUNNING,
        checked_bytes=intake.size_bytes // 3,
        checked_lines=333,
    )

    page = viewer_client.get(f"/intakes/{intake.pk}/").content.decode()

    assert (
        "<strong>Checking every line:</strong> 7.5\xa0KB of 22.5\xa0KB (33.3%), "
        "333 lines so far." in page
    )
    assert '<progress max="100" value="33.3">' in page
    assert '<meta http-equiv="refresh" content="2">' in page


def test_the_progress_page_while_writing(viewer_client, intake):
    Intake.objects.filter(pk=intake.pk).update(
        status=IntakeStatus.RUNNING,
        phase=IntakePhase.WRITING,
        checked_bytes=intake.size_bytes,
        checked_lines=1000,
    )

    page = viewer_client.get(f"/intakes/{intake.pk}/").content.decode()

    assert "Every line is valid (1000 lines):</strong> creating the items" in page


def test_a_failed_intake_lists_its_problems(viewer_client, operator):
    data = b"/ok.wav\nftp://x/a.wav\n" + manifest(10)
    intake = background.start_intake("Bad", SimpleUploadedFile("m.txt", data))
    run_intake(intake.pk)

    response = viewer_client.get(f"/intakes/{intake.pk}/")

    page = response.content.decode()
    assert "The manifest has 1 problem(s); nothing was created." in page
    assert "<strong>Line 2:</strong> the scheme &#x27;ftp:&#x27; is not allowed" in page
    assert "http-equiv" not in page  # final: no more reloading


def test_an_intake_that_stopped_moving_says_so(viewer_client, intake):
    Intake.objects.filter(pk=intake.pk).update(
        status=IntakeStatus.RUNNING,
        updated_at=timezone.now() - timedelta(minutes=10),
    )

    page = viewer_client.get(f"/intakes/{intake.pk}/").content.decode()

    assert "<strong>Interrupted:</strong>" in page


def test_the_intake_page_needs_a_login(client, intake):
    response = client.get(f"/intakes/{intake.pk}/")

    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


# --- Over a real socket: the answer comes before the rest of the body ------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("declared_extra", [5 * 1024 * 1024, 500 * 1024 * 1024])
def test_reading_stops_at_the_limit(live_server, settings, declared_extra):
    """The server answers 413 while the client is still sending: it stopped
    reading at the limit (5 MB more declared), or read nothing at all (500 MB
    more declared than could fit). Before, it read and spooled the whole file."""
    from django.test import Client

    limit = 64 * 1024
    settings.RECALL_MAX_MANIFEST_BYTES = limit
    client = Client()
    client.force_login(make_user("uploader", "Operators"))
    client.get("/batches/new/")  # as a browser would: the CSRF cookie
    session = client.cookies["sessionid"].value
    csrf = client.cookies["csrftoken"].value
    boundary = "recallboundary"
    head = (
        f"--{boundary}\r\nContent-Disposition: form-data; "
        f'name="csrfmiddlewaretoken"\r\n\r\n{csrf}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nBig\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="priority"\r\n\r\n0\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="manifest"; '
        f'filename="m.txt"\r\nContent-Type: text/plain\r\n\r\n'
    ).encode()
    length = len(head) + limit + declared_extra
    host, port = live_server.thread.host, live_server.thread.port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            (
                f"POST /batches/new/ HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Cookie: sessionid={session}; csrftoken={csrf}\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                f"Content-Length: {length}\r\n\r\n"
            ).encode()
            + head
        )
        piece = b"s3://audio/0000001.flac\n" * 2730  # 64 kB
        sent = 0
        deadline = time.monotonic() + 30
        while not select.select([sock], [], [], 0.05)[0]:
            assert time.monotonic() < deadline, "no answer while sending"
            assert sent < limit + declared_extra, "the whole body was read"
            sock.sendall(piece)
            sent += len(piece)
        answer = b""
        while b"\r\n\r\n" not in answer or b"</html>" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data

    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"Recall stopped reading it and created nothing" in answer
    assert sent <= limit + 4 * len(piece)  # what it read past the limit: a chunk or so
    assert not Batch.objects.exists()
