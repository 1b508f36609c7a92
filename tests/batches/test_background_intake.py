"""Background intake: a large manifest stored by the web request and turned into a
batch by the cluster's task, with its progress, its errors, and no duplicate
when the task runs twice. The task is called here as the cluster calls it."""

from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import OperationalError, connection
from django_q.models import OrmQ

from batches.intake_records import Intake, IntakeChunk, IntakePhase, IntakeStatus
from batches.models import Batch, BatchItem
from engine import background_intake as background
from engine.manifests import ManifestInvalid, create_batch
from engine.sweep import sweep
from engine.tasks import run_intake
from tests.support.factories import T0, assert_consistent, failpoint, later, make_user

pytestmark = pytest.mark.django_db


def manifest(n: int, *, bad: dict[int, str] | None = None) -> bytes:
    rows = [f"s3://audio/{i:06d}.flac,{30 + i % 60},en\n" for i in range(n)]
    for index, row in (bad or {}).items():
        rows[index] = row
    return ("source,duration_seconds,language\n" + "".join(rows)).encode()


def upload(data: bytes) -> SimpleUploadedFile:
    return SimpleUploadedFile("manifest.csv", data, content_type="text/csv")


@pytest.fixture
def small_chunks(monkeypatch):
    """Pieces of 1 kB, so a small manifest spans many of them."""
    monkeypatch.setattr(background, "CHUNK_BYTES", 1000)


def test_the_upload_is_stored_in_pieces_and_queued_once_committed(
    small_chunks, django_capture_on_commit_callbacks
):
    data = manifest(200)

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        intake = background.start_intake(" Calls ", upload(data), priority=3, now=T0)

    assert len(callbacks) == 1
    assert (intake.name, intake.priority, intake.status, intake.size_bytes) == (
        "Calls",
        3,
        IntakeStatus.QUEUED,
        len(data),
    )
    pieces = list(intake.chunks.order_by("seq").values_list("data", flat=True))
    assert len(pieces) == -(-len(data) // 1000)
    assert b"".join(bytes(p) for p in pieces) == data
    (queued,) = OrmQ.objects.all()
    assert queued.task["func"] == "engine.tasks.run_intake"
    assert queued.task["args"] == (intake.pk,)
    assert not Batch.objects.exists()


def test_the_task_creates_the_same_batch_as_create_batch(small_chunks, monkeypatch):
    monkeypatch.setattr(background, "PROGRESS_SECONDS", 0)  # record every line
    data = manifest(500)
    owner = make_user("ana", "Operators")
    intake = background.start_intake(
        "Calls", upload(data), priority=2, created_by=owner
    )

    assert run_intake(intake.pk).startswith("done: batch ")

    intake.refresh_from_db()
    batch = intake.batch
    assert (intake.status, intake.phase) == (IntakeStatus.DONE, IntakePhase.WRITING)
    assert (intake.checked_bytes, intake.checked_lines) == (len(data), 501)
    assert intake.attempts == 1
    assert (batch.name, batch.priority, batch.created_by, batch.total) == (
        "Calls",
        2,
        owner,
        500,
    )
    lines = data.decode().splitlines(keepends=True)
    reference = create_batch("reference", lambda: iter(lines))
    assert list(
        BatchItem.objects.filter(batch=batch)
        .order_by("pk")
        .values_list("source", "params", "duration_ms")
    ) == list(
        BatchItem.objects.filter(batch=reference)
        .order_by("pk")
        .values_list("source", "params", "duration_ms")
    )
    assert batch.total_ms == reference.total_ms
    assert not IntakeChunk.objects.exists()  # the pieces go once it is done
    assert_consistent()


@pytest.mark.postgres
@pytest.mark.parametrize("disabled", [False, True])
def test_behind_transaction_pooling_the_task_reads_without_a_server_cursor(
    small_chunks, monkeypatch, disabled
):
    # DATABASE_DISABLE_SERVER_SIDE_CURSORS=on (PgBouncer's transaction mode).
    monkeypatch.setitem(
        connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", disabled
    )
    named = []
    create_cursor = connection.create_cursor

    def recording(name=None):
        named.append(name)
        return create_cursor(name)

    monkeypatch.setattr(connection, "create_cursor", recording)
    intake = background.start_intake("Calls", upload(manifest(300)))

    assert run_intake(intake.pk).startswith("done: batch ")

    assert Batch.objects.get(pk=Intake.objects.get(pk=intake.pk).batch_id).total == 300
    assert any(named) is not disabled  # a named cursor is a server-side one


def test_a_bad_manifest_fails_with_every_line_and_creates_nothing(small_chunks):
    data = manifest(300, bad={10: "ftp://x/a.flac,1,en\n", 250: "-rf,2,en\n"})
    intake = background.start_intake("Calls", upload(data))

    assert run_intake(intake.pk) == "failed: 2 problem(s)"

    intake.refresh_from_db()
    assert intake.status == IntakeStatus.FAILED
    assert intake.total_errors == 2
    assert [e["line"] for e in intake.errors] == [12, 252]
    assert intake.errors[0]["message"].startswith("the scheme 'ftp:' is not allowed")
    assert not Batch.objects.exists()
    assert not IntakeChunk.objects.exists()


def test_a_failure_while_writing_creates_nothing_and_says_so(small_chunks):
    intake = background.start_intake("Calls", upload(manifest(50)))

    with failpoint("batches_batchcounter", "INSERT"):
        assert run_intake(intake.pk) == "failed: unexpected error"

    intake.refresh_from_db()
    assert intake.status == IntakeStatus.FAILED
    assert intake.batch is None
    assert "failpoint" in intake.detail
    assert not Batch.objects.exists()
    assert not BatchItem.objects.exists()


def test_a_second_delivery_of_the_task_does_nothing(small_chunks):
    intake = background.start_intake("Calls", upload(manifest(20)))
    run_intake(intake.pk)

    assert run_intake(intake.pk).startswith("skipped")
    assert Batch.objects.count() == 1


def test_a_running_intake_is_taken_over_only_once_it_is_stale(small_chunks):
    intake = background.start_intake("Calls", upload(manifest(20)), now=T0)
    # A cluster claimed it at T0, then died before it finished.
    Intake.objects.filter(pk=intake.pk).update(status=IntakeStatus.RUNNING)

    assert background.run_intake(intake.pk, now=later(60)).startswith("skipped")
    assert background.run_intake(intake.pk, now=later(301)).startswith("done")
    intake.refresh_from_db()
    assert intake.attempts == 1
    assert Batch.objects.get().total == 20


def test_a_bad_name_stores_nothing():
    with pytest.raises(ManifestInvalid, match="the batch needs a name"):
        background.start_intake("  ", upload(manifest(3)))

    assert not Intake.objects.exists()
    assert not IntakeChunk.objects.exists()


def test_stale_after_follows_the_clusters_retry(settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "retry": 120}

    assert background.stale_after() == timedelta(seconds=120)


# --- Nothing waits for good: the sweep queues a stranded intake again ---------


def test_an_intake_whose_task_never_reached_the_broker_is_queued_again(
    small_chunks, django_capture_on_commit_callbacks
):
    # The hand-off after the commit never ran: the intake is stored, no task.
    intake = background.start_intake("Calls", upload(manifest(20)), now=T0)
    assert not OrmQ.objects.exists()

    assert sweep(now=later(299))["intakes_requeued"] == 0
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep(now=later(301))["intakes_requeued"] == 1

    (queued,) = OrmQ.objects.all()
    assert (queued.task["func"], queued.task["args"]) == (
        "engine.tasks.run_intake",
        (intake.pk,),
    )
    intake.refresh_from_db()
    assert (intake.status, intake.updated_at) == (IntakeStatus.QUEUED, later(301))
    # Queued again at most once per stale_after(): the task may be waiting.
    assert background.requeue_stranded(now=later(600)) == []
    assert background.requeue_stranded(now=later(602)) == [intake.pk]

    assert run_intake(intake.pk).startswith("done: batch ")
    assert Batch.objects.get().total == 20
    assert background.requeue_stranded(now=later(10_000)) == []


def test_a_running_intake_whose_cluster_died_is_queued_again_and_finished(
    small_chunks, django_capture_on_commit_callbacks
):
    intake = background.start_intake("Calls", upload(manifest(20)), now=T0)
    # A cluster claimed it at T0 and died: nobody delivers its task again.
    Intake.objects.filter(pk=intake.pk).update(status=IntakeStatus.RUNNING, attempts=1)
    OrmQ.objects.all().delete()
    fresh = background.start_intake("Later", upload(manifest(5)), now=later(200))

    with django_capture_on_commit_callbacks(execute=True):
        assert background.requeue_stranded(now=later(301)) == [intake.pk]

    intake.refresh_from_db()
    assert (intake.status, intake.attempts) == (IntakeStatus.QUEUED, 1)
    assert [q.task["args"] for q in OrmQ.objects.all()] == [(intake.pk,)]
    assert run_intake(intake.pk).startswith("done: batch ")
    intake.refresh_from_db()
    assert (intake.status, intake.attempts) == (IntakeStatus.DONE, 2)
    assert Intake.objects.get(pk=fresh.pk).status == IntakeStatus.QUEUED


def test_a_run_taken_over_for_being_stale_keeps_nothing_of_its_own(
    small_chunks, monkeypatch
):
    intake = background.start_intake("Calls", upload(manifest(20)), now=T0)
    download = background._download

    def taken_over_meanwhile(intake, spool):
        # While attempt 1 reads the manifest, the sweep finds the intake
        # stale and a second delivery runs it to the end.
        download(intake, spool)
        monkeypatch.setattr(background, "_download", download)
        Intake.objects.filter(pk=intake.pk).update(updated_at=T0)
        assert background.requeue_stranded(now=later(301)) == [intake.pk]
        assert run_intake(intake.pk).startswith("done: batch ")

    monkeypatch.setattr(background, "_download", taken_over_meanwhile)

    assert run_intake(intake.pk) == "skipped: taken over by a later attempt"

    intake.refresh_from_db()
    assert (intake.status, intake.attempts) == (IntakeStatus.DONE, 2)
    assert Batch.objects.get() == intake.batch  # attempt 1's rolled back
    assert BatchItem.objects.count() == 20
    assert_consistent()


def test_a_run_taken_over_does_not_fail_the_later_attempt(small_chunks, monkeypatch):
    intake = background.start_intake(
        "Calls", upload(manifest(20, bad={3: "nope\n"})), now=T0
    )
    download = background._download

    def taken_over_meanwhile(intake, spool):
        download(intake, spool)
        Intake.objects.filter(pk=intake.pk).update(
            status=IntakeStatus.RUNNING, attempts=2
        )

    monkeypatch.setattr(background, "_download", taken_over_meanwhile)

    assert run_intake(intake.pk) == "skipped: taken over by a later attempt"

    intake.refresh_from_db()
    assert (intake.status, intake.attempts) == (IntakeStatus.RUNNING, 2)
    assert (intake.errors, intake.total_errors) == ([], 0)
    assert IntakeChunk.objects.filter(intake=intake).exists()


@pytest.mark.django_db(transaction=True)
def test_a_hand_off_that_fails_after_the_commit_keeps_the_stored_intake(
    small_chunks, monkeypatch, caplog
):
    def broker_down(*args, **kwargs):
        raise OperationalError("the broker is unreachable")

    monkeypatch.setattr("django_q.tasks.async_task", broker_down)

    intake = background.start_intake("Calls", upload(manifest(20)), now=T0)

    assert Intake.objects.get(pk=intake.pk).status == IntakeStatus.QUEUED
    assert IntakeChunk.objects.filter(intake=intake).exists()
    assert "the broker is unreachable" in caplog.text
    monkeypatch.undo()
    assert background.requeue_stranded(now=later(301)) == [intake.pk]
    assert [q.task["args"] for q in OrmQ.objects.all()] == [(intake.pk,)]
