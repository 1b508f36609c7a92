"""The scriptable commands: the LAST line printed is the value."""

import io
import json
import re

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone
from django.utils.module_loading import import_string
from django_q.models import Schedule

from batches.models import Batch
from engine.reconcile import sweep_state
from engine.sweep import LOCK_TTL, acquire_lock
from jobs import transitions
from jobs.models import Job, Worker
from tests.support.factories import claim, later, make_batch, make_worker

pytestmark = pytest.mark.django_db


def run(*args) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_create_worker_prints_the_token_last_and_stores_only_its_hash():
    out, err = run("create_worker", "gpu-box-7")

    token = out.strip().splitlines()[-1]
    worker = Worker.objects.get(name="gpu-box-7")
    assert transitions.authenticate_worker(token)[0] == worker
    assert token not in (worker.token_hash, worker.token_prefix)
    assert "shown only" not in out  # the value is alone on stdout
    assert "gpu-box-7" in err


def test_create_worker_refuses_a_duplicate_name():
    make_worker("gpu-1")

    with pytest.raises(CommandError, match="already exists"):
        run("create_worker", "gpu-1")


def test_create_batch_prints_the_batch_id_last(tmp_path):
    manifest = tmp_path / "m.csv"
    manifest.write_text("source,duration_seconds,lang\n/a.wav,3,en\n/b.wav,4,de\n")

    out, _ = run("create_batch", "Calls", str(manifest), "--priority", "2")

    batch = Batch.objects.get(pk=int(out.strip().splitlines()[-1]))
    assert (batch.name, batch.total, batch.priority, batch.total_ms) == (
        "Calls",
        2,
        2,
        7000,
    )


def test_create_batch_takes_requirements(tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("/a.wav\n")

    out, _ = run(
        "create_batch",
        "Routed",
        str(manifest),
        "--require",
        "model=large-v3",
        "--require",
        "gpu=a100",
    )

    batch = Batch.objects.get(pk=int(out.strip().splitlines()[-1]))
    assert batch.requires == {"gpu": "a100", "model": "large-v3"}


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (["gpu"], "--require: 'gpu' is not KEY=VALUE."),
        (["gpu=a100", "gpu=h100"], "--require: 'gpu' is given twice."),
        (["gpu=a 100"], "--require: value of 'gpu' must be 1 to 63 characters"),
    ],
)
def test_create_batch_with_bad_requirements_creates_nothing(tmp_path, pairs, message):
    manifest = tmp_path / "m.txt"
    manifest.write_text("/a.wav\n")
    args = [arg for pair in pairs for arg in ("--require", pair)]

    with pytest.raises(CommandError, match=re.escape(message)):
        run("create_batch", "x", str(manifest), *args)
    assert not Batch.objects.exists()


def test_create_batch_with_a_bad_manifest_creates_nothing(tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_bytes(b"/ok.wav\n/\xff.wav\n")

    with pytest.raises(CommandError, match="line 2: not valid UTF-8 text"):
        run("create_batch", "x", str(manifest))
    assert not Batch.objects.exists()


def test_create_batch_with_a_missing_file():
    with pytest.raises(CommandError, match=r"Cannot read /nope/m\.txt"):
        run("create_batch", "x", "/nope/m.txt")


def test_recall_sweep_prints_counts_and_a_json_report(worker):
    make_batch(2)
    claim(worker)
    Job.objects.filter(status="leased").update(lease_expires_at=later(-3600))

    out, _ = run("recall_sweep")

    lines = out.strip().splitlines()
    assert lines[0] == "reclaimed: 1 requeued, 0 failed"
    report = json.loads(lines[-1])
    assert report["reclaimed"] == {"requeued": 1, "failed": 0}
    assert report["reconcile"]["items_healed"] == 0
    assert "intakes queued again: 0" in lines
    assert report["intakes_requeued"] == 0
    assert sweep_state().last_finished_at is not None


def test_recall_sweep_skips_reconcile_while_another_sweep_holds_the_lock(db):

    assert acquire_lock("other-host:1", now=timezone.now(), ttl=LOCK_TTL)

    out, _ = run("recall_sweep")

    assert "reconcile: skipped: another sweep is reconciling" in out


def test_recall_check_passes_on_a_consistent_database(worker):
    make_batch(2)
    claim(worker, now=timezone.now())

    out, _ = run("recall_check")

    assert out.strip().splitlines()[-1] == "recall_check: ok, no violations"


def test_recall_check_reports_and_exits_nonzero(worker, capsys):
    batch = make_batch(2)
    Job.objects.filter(batch=batch).update(status="cancelled")
    claim_time = later(0)  # long ago: the lease below is stale
    make_batch(1, name="other")
    claim(worker, now=claim_time)

    out = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("recall_check", stdout=out)

    assert exited.value.code == 1
    lines = out.getvalue().strip().splitlines()
    assert lines[-1] == "recall_check: 3 violation(s) in 2 check(s)"
    assert "item-matches-job: job" in lines[0]
    assert any(
        "was never reclaimed (is the sweeper running?)" in line for line in lines
    )


def test_the_sweep_schedule_exists_after_migrate():
    schedule = Schedule.objects.get(name="recall-sweep")

    assert (
        schedule.func,
        schedule.schedule_type,
        schedule.minutes,
        schedule.repeats,
    ) == (
        "engine.tasks.sweep",
        Schedule.MINUTES,
        1,
        -1,
    )


def test_the_idempotency_keys_schedule_exists_after_migrate_and_runs():
    schedule = Schedule.objects.get(name="recall-idempotency-keys")

    assert (schedule.func, schedule.schedule_type, schedule.repeats) == (
        "engine.tasks.forget_expired_keys",
        Schedule.HOURLY,
        -1,
    )
    # What django-q2 calls: nothing has expired, so nothing is forgotten.
    assert import_string(schedule.func)() == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weight", "0"], "--weight must be a whole number from 1 to 1000, not '0'."),
        (
            ["--weight", "1001"],
            "--weight must be a whole number from 1 to 1000, not '1001'.",
        ),
        (
            ["--weight", "2.5"],
            "--weight must be a whole number from 1 to 1000, not '2.5'.",
        ),
        (
            ["--weight", "abc"],
            "--weight must be a whole number from 1 to 1000, not 'abc'.",
        ),
        (
            ["--max-in-flight", "0"],
            "--max-in-flight must be a whole number from 1 to 1000000, not '0'.",
        ),
        (
            ["--max-in-flight", "-4"],
            "--max-in-flight must be a whole number from 1 to 1000000, not '-4'.",
        ),
        (
            ["--max-in-flight", "many"],
            "--max-in-flight must be a whole number from 1 to 1000000, not 'many'.",
        ),
    ],
)
def test_create_batch_refuses_a_bad_weight_or_cap(tmp_path, flags, message):
    manifest = tmp_path / "m.txt"
    manifest.write_text("/a.wav\n")

    with pytest.raises(CommandError) as refused:
        call_command("create_batch", "Shared", str(manifest), *flags)

    assert str(refused.value) == message
    assert not Batch.objects.exists()


def test_create_batch_takes_weight_and_max_in_flight(tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("/a.wav\n/b.wav\n")
    out = io.StringIO()

    call_command(
        "create_batch",
        "Shared",
        str(manifest),
        "--weight",
        "3",
        "--max-in-flight",
        "8",
        stdout=out,
        stderr=io.StringIO(),
    )

    batch = Batch.objects.get(pk=int(out.getvalue().strip().splitlines()[-1]))
    assert (batch.weight, batch.max_in_flight, batch.total) == (3, 8, 2)
