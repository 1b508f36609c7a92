"""The reference worker, run as a real subprocess against a live Recall server.

Every test waits on conditions it can observe (rows in the database, lines in
the worker's log, processes gone) with a timeout, never on a sleep. Leases are
a few seconds long so that expiry and heartbeats happen within a test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from datetime import timedelta

import pytest
from django.utils import timezone

from batches.models import Batch, BatchItem
from engine.manifests import create_batch
from engine.sweep import sweep
from jobs import transitions
from jobs.models import Job, JobStatus, Lease, LeaseEnd, Worker
from tests.support.factories import assert_consistent, jobs_of, make_batch, make_worker
from tests.support.worker import (
    FAKE_ENGINE,
    FAKE_ENGINE_COMMAND,
    batch_with_modes,
    engine_records,
    process_gone,
    wait_for,
)

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

LEASE_SECONDS = 3  # the server asks for a heartbeat every second


@pytest.fixture(autouse=True)
def _short_leases(settings):
    settings.RECALL_LEASE_SECONDS = LEASE_SECONDS
    settings.RECALL_RETRY_BACKOFF_SECONDS = 0


def status_of(job: Job) -> str:
    return Job.objects.values_list("status", flat=True).get(pk=job.pk)


def ledger(job: Job) -> list[tuple[str | None, str]]:
    """(end reason, worker name) of each lease of ``job``, oldest first."""
    return [
        (lease.end_reason, lease.worker.name)
        for lease in Lease.objects.filter(job=job)
        .select_related("worker")
        .order_by("pk")
    ]


def leased_job(batch) -> Job | None:
    return Job.objects.filter(batch=batch, status=JobStatus.LEASED).first()


def test_happy_path_drains_a_batch_and_stores_results(start_worker):
    batch = make_batch(durations=[4, 8, 6, 10, 5, 7], now=timezone.now())
    worker = make_worker("gpu-1")
    proc = start_worker(
        worker, "--simulate", "--simulate-factor=0.1", "--concurrency=2"
    )

    wait_for(
        lambda: (
            not Job.objects.filter(batch=batch)
            .exclude(status=JobStatus.COMPLETED)
            .exists()
        ),
        what="every job completed",
        workers=(proc,),
    )

    for job in jobs_of(batch):
        assert job.item.status == "done"
        assert job.result["language"] == "en"
        assert job.result["text"]
        segments = job.result["segments"]
        assert segments[0]["start"] == 0
        assert segments[-1]["end"] <= job.item.duration_seconds
        assert ledger(job) == [(LeaseEnd.COMPLETED, "gpu-1")]
        assert f"job={job.pk} attempt=1/3 completed" in proc.log()
    assert batch.counts()["done"] == 6
    # --concurrency 2: two leases at a time, never more.
    leases = list(Lease.objects.filter(job__batch=batch))
    overlap = max(
        sum(1 for b in leases if b.claimed_at <= a.claimed_at < b.ended_at)
        for a in leases
    )
    assert overlap == 2
    assert_consistent(timezone.now())

    proc.send(signal.SIGTERM)
    assert proc.exit_code() == 0


def answered(endpoint: str, status: str = "200") -> float:
    """Worker API requests this process's server answered so far (the live
    server runs in the test's process: its request metrics are ours)."""
    from api.request_metrics import request_metrics

    (family,) = request_metrics().requests.collect()
    return sum(
        sample.value
        for sample in family.samples
        if sample.name.endswith("_total")
        and sample.labels == {"endpoint": endpoint, "status": status}
    )


def test_a_labelled_worker_with_many_slots_takes_its_routed_batch_in_few_calls(
    start_worker,
):
    """Four slots: claims ask for every free slot at once, with the worker's
    labels; one batched heartbeat a second renews every lease; a batch that
    requires a label only this worker offers is done by it alone."""
    routed = make_batch(name="large", durations=[30.0] * 4, now=timezone.now())
    Batch.objects.filter(pk=routed.pk).update(requires={"model": "large-v3"})
    plain = make_batch(3, name="plain", now=timezone.now())
    single_before = answered("heartbeat")
    batched_before = answered("heartbeat_many")
    big = start_worker(
        make_worker("gpu-big"),
        "--simulate",
        "--simulate-factor=0.1",  # 3 s a job: three heartbeat intervals
        "--concurrency=4",
        "--label=model=large-v3",
        "--label",
        "gpu=a100",
    )
    small = start_worker(make_worker("cpu-small"), "--simulate")

    wait_for(
        lambda: all(
            status_of(job) == JobStatus.COMPLETED
            for job in [*jobs_of(routed), *jobs_of(plain)]
        ),
        timeout=60,
        what="both batches done",
        workers=(big, small),
    )

    assert {ledger(job)[-1] for job in jobs_of(routed)} == {
        (LeaseEnd.COMPLETED, "gpu-big")
    }
    assert Worker.objects.get(name="gpu-big").labels == {
        "gpu": "a100",
        "model": "large-v3",
    }
    assert Worker.objects.get(name="cpu-small").labels == {}
    assert answered("heartbeat") == single_before  # never one lease at a time
    assert answered("heartbeat_many") - batched_before >= 2
    assert "lease lost" not in big.log()


def test_heartbeats_keep_a_long_job_past_several_lease_lengths(start_worker):
    # 100 s of audio at 0.1 s per second: 10 s of work, over three leases.
    batch = make_batch(durations=[100], now=timezone.now())
    proc = start_worker(make_worker(), "--simulate", "--simulate-factor=0.1")

    # Reclaim anything expired on every poll: one missed heartbeat would lose it.
    wait_for(
        lambda: status_of(jobs_of(batch)[0]) == JobStatus.COMPLETED,
        timeout=30,
        what="the long job completed",
        workers=(proc,),
        every=lambda: transitions.reclaim_expired(),
    )

    (lease,) = Lease.objects.filter(job__batch=batch)
    assert lease.end_reason == LeaseEnd.COMPLETED
    assert lease.ended_at - lease.claimed_at > timedelta(seconds=3 * LEASE_SECONDS)
    assert lease.heartbeat_at - lease.claimed_at > timedelta(seconds=2 * LEASE_SECONDS)


def test_lease_lost_on_heartbeat_kills_the_engine_and_never_completes(start_worker):
    batch = batch_with_modes(["hang-once"])
    (job,) = jobs_of(batch)
    proc = start_worker(make_worker(), "--command", FAKE_ENGINE_COMMAND)
    (record,) = wait_for(
        lambda: engine_records(start_worker.engine_dir),
        what="the engine started",
        workers=(proc,),
    )
    first_token = Job.objects.get(pk=job.pk).lease_token

    assert transitions.force_reclaim(job)  # the next heartbeat gets 409

    wait_for(
        lambda: process_gone(record["pid"]) and process_gone(record["child"]),
        what="the engine and its child killed",
        workers=(proc,),
    )
    assert f"job={job.pk} attempt=1/3 lease lost on heartbeat" in proc.log()
    # The worker moved on: it claims the job again and this time completes it.
    wait_for(
        lambda: status_of(job) == JobStatus.COMPLETED,
        what="the job completed by a new lease",
        workers=(proc,),
    )
    first = Lease.objects.get(token=first_token)
    assert first.end_reason == LeaseEnd.FORCED
    assert ledger(job) == [(LeaseEnd.FORCED, "gpu-1"), (LeaseEnd.COMPLETED, "gpu-1")]
    assert f"job={job.pk} attempt=1/3 abandoned" in proc.log()


def test_sigterm_kills_the_engine_releases_the_lease_and_exits_0(start_worker):
    batch = batch_with_modes(["hang"])
    (job,) = jobs_of(batch)
    proc = start_worker(make_worker(), "--command", FAKE_ENGINE_COMMAND)
    (record,) = wait_for(
        lambda: engine_records(start_worker.engine_dir),
        what="the engine started",
        workers=(proc,),
    )

    proc.send(signal.SIGTERM)

    assert proc.exit_code() == 0
    # Queued at once (no waiting for the lease to expire), the attempt refunded.
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED
    assert job.available_at <= timezone.now()
    assert job.attempts == 0
    assert ledger(job) == [(LeaseEnd.RELEASED, "gpu-1")]
    assert process_gone(record["pid"])
    wait_for(lambda: process_gone(record["child"]), what="the engine's child killed")
    assert f"job={job.pk} attempt=1/3 released" in proc.log()


def test_a_second_signal_exits_at_once(start_worker, proxy):
    batch = batch_with_modes(["hang"])
    (job,) = jobs_of(batch)
    proc = start_worker(make_worker(), "--command", FAKE_ENGINE_COMMAND, url=proxy.url)
    (record,) = wait_for(
        lambda: engine_records(start_worker.engine_dir),
        what="the engine started",
        workers=(proc,),
    )
    proxy.stop()  # the release cannot get through: the worker keeps trying
    proc.send(signal.SIGTERM)
    wait_for(
        lambda: f"job={job.pk} attempt=1/3 release failed" in proc.log(),
        what="the release retried",
        workers=(proc,),
    )

    proc.send(signal.SIGTERM)

    assert proc.exit_code(timeout=3) == 128 + signal.SIGTERM
    assert process_gone(record["pid"])


def test_sigkill_leaves_a_lease_the_sweeper_reclaims_for_another_worker(
    start_worker,
):
    batch = make_batch(durations=[600], now=timezone.now())
    (job,) = jobs_of(batch)
    doomed = start_worker(make_worker("doomed"), "--simulate", "--simulate-factor=1")
    wait_for(lambda: leased_job(batch), what="the job leased", workers=(doomed,))

    doomed.send(signal.SIGKILL)
    assert doomed.exit_code() == -signal.SIGKILL

    # Nothing released it: the lease runs out, and only then does the sweep
    # take the job back.
    assert status_of(job) == JobStatus.LEASED
    expires = Job.objects.get(pk=job.pk).lease_expires_at
    wait_for(lambda: timezone.now() > expires, what="the lease to expire")
    report = sweep()
    assert report["reclaimed"] == {"requeued": 1, "failed": 0}
    assert status_of(job) == JobStatus.QUEUED

    rescuer = start_worker(
        make_worker("rescuer"), "--simulate", "--simulate-factor=0.001"
    )
    wait_for(
        lambda: status_of(job) == JobStatus.COMPLETED,
        what="another worker completed the job",
        workers=(rescuer,),
    )
    assert ledger(job) == [
        (LeaseEnd.EXPIRED, "doomed"),
        (LeaseEnd.COMPLETED, "rescuer"),
    ]
    assert Job.objects.get(pk=job.pk).attempts == 2
    assert f"job={job.pk} attempt=2/3 completed" in rescuer.log()


def test_a_completion_survives_the_server_going_away(start_worker, proxy):
    batch = make_batch(durations=[30], now=timezone.now())  # 3 s of work
    (job,) = jobs_of(batch)
    proc = start_worker(
        make_worker(), "--simulate", "--simulate-factor=0.1", url=proxy.url
    )
    wait_for(lambda: leased_job(batch), what="the job leased", workers=(proc,))

    proxy.stop()
    # The engine finishes while the server is away: the completion is retried,
    # for longer than the lease lasts (nothing reclaims it meanwhile, so the
    # lease is still live when the server comes back).
    expires = Job.objects.get(pk=job.pk).lease_expires_at
    wait_for(
        lambda: (
            proc.log().count(f"job={job.pk} attempt=1/3 complete failed") >= 3
            and timezone.now() > expires + timedelta(seconds=1)
        ),
        what="the completion retried past the lease's expiry",
        workers=(proc,),
    )
    assert status_of(job) == JobStatus.LEASED
    proxy.start()  # back, on the same address

    wait_for(
        lambda: status_of(job) == JobStatus.COMPLETED,
        what="the completion delivered",
        workers=(proc,),
    )
    assert ledger(job) == [(LeaseEnd.COMPLETED, "gpu-1")]
    assert Job.objects.get(pk=job.pk).result["text"]


def test_a_lost_completion_response_is_retried_and_accepted(start_worker, proxy):
    batch = make_batch(durations=[30], now=timezone.now())  # 3 s of work
    (job,) = jobs_of(batch)
    proc = start_worker(
        make_worker(), "--simulate", "--simulate-factor=0.1", url=proxy.url
    )
    wait_for(lambda: leased_job(batch), what="the job leased", workers=(proc,))

    # Requests reach the server, but no answer comes back.
    proxy.drop_responses = True
    wait_for(
        lambda: (
            status_of(job) == JobStatus.COMPLETED
            and f"job={job.pk} attempt=1/3 complete failed" in proc.log()
        ),
        what="the completion stored, but its answer lost",
        workers=(proc,),
    )
    proxy.drop_responses = False

    # The retry, with the same token, is accepted (complete is idempotent).
    wait_for(
        lambda: f"job={job.pk} attempt=1/3 completed" in proc.log(),
        what="the worker to see its completion accepted",
        workers=(proc,),
    )
    assert ledger(job) == [(LeaseEnd.COMPLETED, "gpu-1")]
    assert "result discarded" not in proc.log()


def test_command_engine_results_from_stdout_files_and_text(start_worker):
    batch = batch_with_modes(["json", "outfile", "text"])
    proc = start_worker(
        make_worker(), "--command", FAKE_ENGINE_COMMAND, "--concurrency=3"
    )
    wait_for(
        lambda: (
            not Job.objects.filter(batch=batch)
            .exclude(status=JobStatus.COMPLETED)
            .exists()
        ),
        what="every job completed",
        workers=(proc,),
    )

    json_job, file_job, text_job = jobs_of(batch)
    for job in (json_job, file_job):
        assert job.result == {
            "text": f"fake transcript of {job.item.source}",
            "segments": [
                {"start": 0.0, "end": 1.5, "text": "fake transcript"},
                {"start": 1.5, "end": 2.0, "text": f"of {job.item.source}"},
            ],
            "language": "en",
            "saw_token": False,  # the worker's token is not the engine's business
            "saw_job_id": str(job.pk),
        }
    assert text_job.result == {"text": f"plain transcript of {text_job.item.source}"}


def test_engine_exit_codes_and_timeouts(start_worker, settings):
    settings.RECALL_MAX_ATTEMPTS = 2
    batch = batch_with_modes(["exit:65", "exit:1", "hang"])
    bad_input, crash, slow = jobs_of(batch)
    proc = start_worker(
        make_worker(),
        "--command",
        FAKE_ENGINE_COMMAND,
        "--concurrency=3",
        "--timeout=1",
    )
    wait_for(
        lambda: (
            not Job.objects.filter(batch=batch)
            .exclude(status=JobStatus.FAILED)
            .exists()
        ),
        what="every job failed",
        workers=(proc,),
    )

    # 65 (EX_DATAERR): not retried.
    assert ledger(bad_input) == [(LeaseEnd.FAILED, "gpu-1")]
    bad_input.refresh_from_db()
    assert bad_input.last_error.startswith("The engine exited with status 65.")
    assert "error: the decoder gave up on this file" in bad_input.last_error
    # Any other status, and a timeout: retried until the attempts run out.
    assert ledger(crash) == [(LeaseEnd.FAILED, "gpu-1")] * 2
    crash.refresh_from_db()
    assert crash.last_error.startswith("The engine exited with status 1.")
    assert ledger(slow) == [(LeaseEnd.FAILED, "gpu-1")] * 2
    slow.refresh_from_db()
    assert slow.last_error == "The engine timed out after 1s and was killed."
    for record in engine_records(start_worker.engine_dir):
        wait_for(lambda r=record: process_gone(r["child"]), what="engines killed")


@pytest.mark.parametrize(
    ("disable", "expected"), [(False, "401"), (True, "403")], ids=["401", "403"]
)
def test_a_refused_worker_exits_3_with_a_clear_message(start_worker, disable, expected):
    worker = make_worker()
    if disable:
        worker.is_active = False
        worker.save()
    else:
        worker.token = "not-the-token-of-anyone"
    proc = start_worker(worker, "--simulate")

    assert proc.exit_code() == 3
    assert f"the server refused this worker: {expected}" in proc.log()


def test_sigkill_of_the_worker_kills_its_engine(start_worker):
    batch = batch_with_modes(["hang"])
    proc = start_worker(make_worker(), "--command", FAKE_ENGINE_COMMAND)
    (record,) = wait_for(
        lambda: engine_records(start_worker.engine_dir),
        what="the engine started",
        workers=(proc,),
    )
    try:
        proc.send(signal.SIGKILL)  # no handler runs: the kernel ends the engine
        assert proc.exit_code() == -signal.SIGKILL

        wait_for(
            lambda: process_gone(record["pid"]),
            timeout=5,
            what="the engine to die with its worker",
        )
    finally:
        # What the engine itself started is not covered (docs/reference/worker.md): clean it up.
        for pid in (record["pid"], record["child"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert status_of(jobs_of(batch)[0]) == JobStatus.LEASED  # for the sweep to reclaim


def test_sources_outside_the_source_root_fail_without_a_retry(start_worker, tmp_path):
    root = tmp_path / "audio"
    (root / "in").mkdir(parents=True)
    (root / "in" / "a.wav").write_bytes(b"RIFF")
    (root / "link").symlink_to(tmp_path)  # inside, but leads out
    sources = [
        f"{root}/in/a.wav",
        f"file://{root}/in/a.wav",
        f"{root}/in/../../secret.wav",
        f"file://{root}/link/secret.wav",
        "s3://bucket/remote.wav",
    ]
    manifest = "source,mode\n" + "".join(f"{s},json\n" for s in sources)
    lines = manifest.splitlines(keepends=True)
    batch = create_batch("rooted", lambda: iter(lines), now=timezone.now())
    proc = start_worker(
        make_worker(), "--command", FAKE_ENGINE_COMMAND, "--source-root", str(root)
    )

    wait_for(
        lambda: (
            not Job.objects.filter(
                batch=batch, status__in=[JobStatus.QUEUED, JobStatus.LEASED]
            ).exists()
        ),
        what="every job finished",
        workers=(proc,),
    )

    jobs = jobs_of(batch)
    assert [status_of(job) for job in jobs] == [
        JobStatus.COMPLETED,
        JobStatus.COMPLETED,
        JobStatus.FAILED,
        JobStatus.FAILED,
        JobStatus.COMPLETED,
    ]
    for job in jobs[2:4]:
        job.refresh_from_db()
        assert ledger(job) == [(LeaseEnd.FAILED, "gpu-1")]  # one attempt: no retry
        assert job.last_error == (
            f"The source {job.item.source!r} is outside --source-root {root} (after "
            f"resolving '..' and symbolic links); refused without a retry."
        )
    # The engine got the checked path; the source itself is unchanged.
    assert jobs[1].result["text"] == f"fake transcript of file://{root}/in/a.wav"


def test_values_an_engine_would_take_for_options_fail_for_good_unstarted(
    start_worker, tmp_path
):
    # Intake refuses such sources now; rows written before it did (or by an
    # older server) still reach workers: two are rewritten here as they were.
    lines = ["source,mode\n"] + [f"/audio/{n}.wav,json\n" for n in range(4)]
    batch = create_batch("options", lambda: iter(lines), now=timezone.now())
    plain, param, encoded, raw = jobs_of(batch)
    BatchItem.objects.filter(pk=param.item_id).update(
        params={"mode": "--model=../../evil"}
    )
    BatchItem.objects.filter(pk=encoded.item_id).update(source="file:%2Drf")
    BatchItem.objects.filter(pk=raw.item_id).update(source="file:--output_dir=/etc")
    command = f"{sys.executable} {FAKE_ENGINE} {{params[mode]}} {{source_path}}"
    proc = start_worker(make_worker(), "--command", command)

    wait_for(
        lambda: (
            not Job.objects.filter(
                batch=batch, status__in=[JobStatus.QUEUED, JobStatus.LEASED]
            ).exists()
        ),
        what="every job finished",
        workers=(proc,),
    )

    assert [status_of(job) for job in (plain, param, encoded, raw)] == [
        JobStatus.COMPLETED,
        JobStatus.FAILED,
        JobStatus.FAILED,
        JobStatus.FAILED,
    ]
    for job, placeholder, value in (
        (param, "params[mode]", "--model=../../evil"),
        (encoded, "source_path", "-rf"),
        (raw, "source_path", "--output_dir=/etc"),
    ):
        job.refresh_from_db()
        assert ledger(job) == [(LeaseEnd.FAILED, "gpu-1")]  # one attempt: no retry
        assert job.last_error == (
            f"The command line would get {value!r} for {{{placeholder}}}, which "
            f"starts with '-', which an engine would read as an option; refused "
            f"without a retry, the engine was not started."
        )
    # The engine ran for the plain item only.
    ran = sorted(p.name for p in start_worker.engine_dir.glob("*.ran"))
    assert ran == [f"{plain.pk}.ran"]


def test_a_rate_limited_worker_waits_as_told_and_finishes_its_work(
    start_worker, settings
):
    """The server holds the worker to one request a second (bursts of two):
    its calls get 429 rate_limited with a Retry-After, it waits at least
    that long before each retry, and every job still completes, once."""
    settings.RECALL_WORKER_RATE_PER_SECOND = 1
    settings.RECALL_WORKER_RATE_BURST = 2
    batch = make_batch(durations=[2, 2, 2, 2], now=timezone.now())
    proc = start_worker(make_worker("gpu-1"), "--simulate", "--simulate-factor=0.5")

    wait_for(
        lambda: (
            not Job.objects.filter(batch=batch)
            .exclude(status=JobStatus.COMPLETED)
            .exists()
        ),
        timeout=60,
        what="every job completed",
        workers=(proc,),
    )

    waits = re.findall(
        r"failed \(HTTP 429 rate_limited: .*?\); retry \d+ in ([\d.]+)s", proc.log()
    )
    assert waits, proc.log()
    assert min(float(wait) for wait in waits) >= 1.0
    for job in jobs_of(batch):
        assert ledger(job) == [(LeaseEnd.COMPLETED, "gpu-1")]
