"""`make demo`: the whole of Recall alive on this machine, in one command.

A fresh demo database (SQLite, under var/demo/, apart from `make run`'s), a
demo admin login, demo batches with a few hundred items that have durations,
gunicorn and the django-q2 cluster, and three reference workers with the
simulated engine. Routing: one batch requires the label model=large-v3, which
only worker gpu-1 offers (``--label``), so only gpu-1 takes its jobs. Re-run:
each batch that finishes with transcripts flagged short has those re-run once,
by the same transition as the batch page's Re-run button and the Operator
API's ``POST /api/v1/batches/<id>/rerun`` (``transitions.rerun``, as the demo
login), on the workers offering model=large-v3 (gpu-1 alone): the finished
batch runs again, finishes again, and each re-run item's page shows its
earlier run. One of
the workers is killed with SIGKILL and restarted every so often, so its leases
expire and are reclaimed while you watch. Leases are short
(RECALL_LEASE_SECONDS=15) so that happens within seconds.

The terminal shows the URL, the login, progress, and every kill and reclaim;
the processes' own logs go to var/demo/logs/. Ctrl-C stops everything this
started, in order: workers first (they release their leases), then the web
server, then the cluster (exactly one SIGTERM: a second can hang django-q2).
A second Ctrl-C kills whatever is left at once.

Settings (environment): RECALL_BIND (default 127.0.0.1:8000), DEMO_ITEMS (300),
DEMO_KILL_EVERY (seconds between kills, default 45), DEMO_SPEED (simulated
seconds of work per second of audio, default 0.03).
"""

from __future__ import annotations

import contextlib
import csv
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project is one level up

from harness.server import Process, Server  # noqa: E402

VAR = ROOT / "var" / "demo"
LOGS = VAR / "logs"
PY = sys.executable
WORKER = ROOT / "worker" / "recall_worker.py"

BIND = os.environ.get("RECALL_BIND", "127.0.0.1:8000")
ITEMS = int(os.environ.get("DEMO_ITEMS", "300"))
KILL_EVERY = float(os.environ.get("DEMO_KILL_EVERY", "45"))
SPEED = float(os.environ.get("DEMO_SPEED", "0.03"))
LEASE_SECONDS = 15
PROGRESS_EVERY = 10.0
RESTART_AFTER = 5.0
ADMIN = "demo"
# Routing: the labels each demo worker offers with its claims, and the batch
# that requires one only gpu-1 offers.
WORKER_LABELS = {
    "gpu-1": {"gpu": "a100", "model": "large-v3"},
    "gpu-2": {"gpu": "l4"},
    "gpu-flaky": {"gpu": "l4"},
}
ROUTED_BATCH = "Demo: lectures (large-v3 only)"
ROUTED_REQUIRES = {"model": "large-v3"}
# Re-run: the flag whose items each finished batch re-runs once, and the
# requirement of the new run (which only gpu-1 offers).
RERUN_FLAG = "short"
RERUN_REQUIRES = {"model": "large-v3"}


def say(message: str) -> None:
    """Print a line; a closed terminal or pipe must not stop the clean-up."""
    with contextlib.suppress(OSError):
        print(f"{time.strftime('%H:%M:%S')}  {message}", flush=True)


def configure_environment() -> None:
    """Everything the demo's processes read, set before Django is imported.

    DATABASE_URL is set explicitly: a .env pointing at a real database must
    never receive the demo's batches.
    """
    os.chdir(ROOT)
    VAR.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(exist_ok=True)
    from recall_site.secret_key import key_file

    os.environ.update(
        DJANGO_SETTINGS_MODULE="recall_site.settings",
        RECALL_VAR_DIR=str(VAR),
        DATABASE_URL=f"sqlite:///{VAR / 'recall.sqlite3'}",
        SECRET_KEY=key_file(VAR / "secret_key"),
        RECALL_HTTPS="off",
        RECALL_BIND=BIND,
        RECALL_LEASE_SECONDS=str(LEASE_SECONDS),
        RECALL_RETRY_BACKOFF_SECONDS="10",
        RECALL_ACCESS_LOG=str(LOGS / "access.log"),
        WEB_CONCURRENCY=os.environ.get("WEB_CONCURRENCY", "2"),
        RECALL_STARTUP_SWEEP="quick",
    )


def fresh_database() -> None:
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            (VAR / f"recall.sqlite3{suffix}").unlink()
    for log in LOGS.glob("*.log"):
        log.unlink()


# A few items of every manifest whose transcripts come out wrong, so the quality
# flags have something to show: the simulated engine hears nothing (empty), one
# sentence of a long recording (short), or English where German was asked for
# (language_mismatch). {item number: (language, params.simulate, min seconds)}.
FLAGGED = {3: ("en", "silence", 0), 8: ("en", "mumble", 90), 13: ("de", "", 0)}


def manifest(path: Path, prefix: str, n: int, seed: int, median: float) -> float:
    """A CSV manifest of ``n`` items with realistic durations (a few of them
    flagged when done: FLAGGED); returns hours."""
    rng = random.Random(seed)
    total = 0.0
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["source", "duration_seconds", "language", "simulate"])
        for i in range(1, n + 1):
            seconds = round(min(3600, max(20, rng.lognormvariate(0, 0.8) * median)), 1)
            language, quirk, at_least = FLAGGED.get(i, ("en", "", 0))
            seconds = max(seconds, at_least)
            total += seconds
            source = f"s3://demo-audio/{prefix}-{i:04d}.wav"
            out.writerow([source, seconds, language, quirk])
    return total / 3600


def set_up() -> tuple[str, dict[str, str]]:
    """Migrate, then the admin login, the workers and the batches."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connections

    from engine.manifests import create_batch, file_lines
    from jobs import transitions

    say("migrating the demo database and collecting static files ...")
    call_command("migrate", interactive=False, verbosity=0)
    call_command("collectstatic", interactive=False, verbosity=0)
    password = secrets.token_urlsafe(9)
    get_user_model().objects.create_superuser(ADMIN, "demo@example.com", password)
    tokens = {}
    for name in WORKER_LABELS:
        _, tokens[name] = transitions.create_worker(name)
    hours = manifest(VAR / "interviews.csv", "interview", ITEMS, 5, 300)
    create_batch("Demo: field interviews", file_lines(VAR / "interviews.csv"))
    urgent = max(5, ITEMS // 25)
    hours += manifest(VAR / "press.csv", "press-call", urgent, 7, 120)
    create_batch(
        "Demo: press calls (urgent)", file_lines(VAR / "press.csv"), priority=10
    )
    lectures = max(5, ITEMS // 10)
    hours += manifest(VAR / "lectures.csv", "lecture", lectures, 13, 240)
    create_batch(
        ROUTED_BATCH, file_lines(VAR / "lectures.csv"), requires=ROUTED_REQUIRES
    )
    say(
        f"created 3 batches: {ITEMS} interviews, {urgent} urgent press calls and "
        f"{lectures} lectures, {hours:.1f} hours of audio"
    )
    say(f"routing: {routing_sentence()}")
    # The operator API: a token for the demo login and a manifest to submit.
    from operator_api.tokens import issue_token

    admin = get_user_model().objects.get(username=ADMIN)
    _, api_token = issue_token(admin, label="demo", now=transitions.now())
    token_file = VAR / "api_token"
    token_file.write_text(api_token + "\n")
    token_file.chmod(0o600)
    manifest(VAR / "pipeline.csv", "pipeline", 20, 11, 30)
    connections.close_all()
    return password, tokens


def pairs(labels: dict[str, str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(labels.items()))


def routing_sentence() -> str:
    """What the demo shows of routing, in words: which batch requires what,
    and which worker alone offers it."""
    offering = [
        name
        for name, labels in WORKER_LABELS.items()
        if all(labels.get(k) == v for k, v in ROUTED_REQUIRES.items())
    ]
    return (
        f"{ROUTED_BATCH!r} requires {pairs(ROUTED_REQUIRES)}, which only worker "
        f"{' and '.join(offering)} offers (--label {pairs(ROUTED_REQUIRES)}): "
        f"only it takes that batch's jobs"
    )


def routed_progress() -> str | None:
    """The routed batch's progress and who did its jobs, from the ledger."""
    from batches.models import Batch
    from jobs.models import Lease, LeaseEnd

    batch = Batch.objects.filter(name=ROUTED_BATCH).first()
    if batch is None:
        return None
    counts = batch.counts()
    done_by = sorted(
        set(
            Lease.objects.filter(
                job__batch=batch, end_reason=LeaseEnd.COMPLETED
            ).values_list("worker__name", flat=True)
        )
    )
    by = f", all by {' and '.join(done_by)}" if done_by else ""
    return (
        f"routing: {batch.name} ({pairs(batch.requires)}): "
        f"{counts['done']}/{batch.total} done{by}"
    )


class Reruns:
    """The demo's operator re-running what came out wrong: each batch that
    finishes with items flagged RERUN_FLAG has them re-run once, on the
    workers offering RERUN_REQUIRES, through ``transitions.rerun`` as the
    demo login (the batch page and the Operator API call it so too); when the
    batch finishes again, the terminal says so."""

    def __init__(self) -> None:
        self.rerun: dict[int, int] = {}  # batch id -> items re-run
        self.refinished: set[int] = set()

    def new_lines(self) -> list[str]:
        """Re-run the batches that finished since the last call, and report
        those whose re-run finished (one query for the batches, a few small
        ones per batch that finished)."""
        from django.contrib.auth import get_user_model

        from batches.models import Batch, flag_counts
        from jobs import transitions

        lines = []
        finished = Batch.objects.filter(
            finished_at__isnull=False, cancelled_at__isnull=True
        ).exclude(pk__in=self.refinished)
        for batch in finished.order_by("pk"):
            if batch.pk in self.rerun:
                self.refinished.add(batch.pk)
                n = self.rerun[batch.pk]
                lines.append(
                    f"re-run: {batch.name} finished again; each re-run item's "
                    f"page shows its earlier run ({n} item{'s' * (n != 1)})"
                )
                continue
            flagged = flag_counts(batch.counts())[RERUN_FLAG]
            if not flagged:
                self.rerun[batch.pk] = 0
                self.refinished.add(batch.pk)
                continue
            operator = get_user_model().objects.get(username=ADMIN)
            n = transitions.rerun(
                batch, flag=RERUN_FLAG, requires=RERUN_REQUIRES, actor=operator
            )
            self.rerun[batch.pk] = n
            if not n:  # nothing was done and flagged after all: not reopened
                self.refinished.add(batch.pk)
                continue
            lines.append(
                f"re-run: {batch.name} finished with {n} transcript"
                f"{'s' * (n != 1)} flagged {RERUN_FLAG}; re-running "
                f"{'them' if n != 1 else 'it'} on the workers offering "
                f"{pairs(RERUN_REQUIRES)} (the batch page's Re-run, as {ADMIN})"
            )
        return lines

    def settled(self) -> bool:
        """Every batch that is not cancelled has finished, and finished again
        after its re-run if it had one."""
        from batches.models import Batch

        return not (
            Batch.objects.filter(cancelled_at__isnull=True)
            .exclude(pk__in=self.refinished)
            .exists()
        )


def stop(child: Process, timeout: float) -> None:
    """One SIGTERM to the child alone (Ctrl-C reached only the demo, which stops
    each child the way it wants); SIGKILL its whole session if it is not gone
    in time, and in any case after, so nothing it started is left."""
    if child.alive():
        child.terminate()
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            say(f"{child.name} did not stop within {timeout:g}s: killing it")
    child.kill()


def demo_process(
    name: str, argv: list[str], env: dict[str, str] | None = None
) -> Process:
    """A process this demo starts (later), in a session of its own, its output
    in var/demo/logs/<name>.log."""
    return Process(
        name, argv, {**os.environ, **(env or {})}, LOGS / f"{name}.log", start=False
    )


class Demo:
    def __init__(self, tokens: dict[str, str]):
        url = f"http://{BIND}"
        self.url = url
        self.cluster = demo_process("qcluster", [PY, "manage.py", "qcluster"])
        # gunicorn.conf.py through the harness (harness/server.py).
        self.web = Server(os.environ, LOGS / "gunicorn.log", bind=BIND, start=False)
        self.workers = {
            name: demo_process(
                f"worker-{name}",
                [
                    PY,
                    str(WORKER),
                    "--simulate",
                    "--concurrency=2",
                    f"--simulate-factor={SPEED}",
                    "--simulate-fail-rate=0.03",
                    "--poll-max=5",
                    *(f"--label={k}={v}" for k, v in WORKER_LABELS[name].items()),
                ],
                env={"RECALL_URL": url, "RECALL_TOKEN": token},
            )
            for name, token in tokens.items()
        }
        self.flaky = self.workers["gpu-flaky"]
        self.rng = random.Random()
        self.next_kill = time.monotonic() + self._kill_interval()
        self.restart_at: float | None = None
        self.next_progress = time.monotonic() + PROGRESS_EVERY
        self.reclaims = ReclaimWatch()
        self.reruns = Reruns()
        self.done_history: list[tuple[float, int]] = []
        self.finished = False
        self.stop_requested = False

    def _kill_interval(self) -> float:
        return KILL_EVERY * self.rng.uniform(0.7, 1.3)

    def start(self) -> None:
        self.cluster.start()
        self.web.start()
        self.wait_until_serving()
        if self.stop_requested:
            return
        for worker in self.workers.values():
            worker.start()

    def wait_until_serving(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stop_requested:
                return
            if not self.web.alive():
                raise Fatal(f"gunicorn exited at start-up:\n{self.web.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/admin/login/", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        raise Fatal(f"gunicorn did not answer within {timeout:g}s:\n{self.web.tail()}")

    def tick(self) -> None:
        """Once every half second: watch the children, cause chaos, report."""
        for child in (self.web, self.cluster):
            if not child.alive():
                raise Fatal(f"{child.name} exited unexpectedly:\n{child.tail()}")
        now = time.monotonic()
        for name, worker in self.workers.items():
            if worker is self.flaky and self.restart_at is not None:
                continue
            if not worker.alive():
                say(f"worker {name} exited ({worker.returncode}); restarting it")
                worker.kill()
                worker.start()
        if self.restart_at is not None and now >= self.restart_at:
            self.flaky.start()
            self.restart_at = None
            say("chaos: restarted worker gpu-flaky")
        elif self.restart_at is None and now >= self.next_kill:
            self.kill_flaky()
        self.report_reclaims()
        self.report_reruns()
        if now >= self.next_progress:
            self.next_progress = now + PROGRESS_EVERY
            self.report_progress()

    def kill_flaky(self) -> None:
        from django.utils import timezone

        from jobs.models import Job, JobStatus

        # Live leases only: those of a previous kill may still await reclaim.
        held = list(
            Job.objects.filter(
                status=JobStatus.LEASED,
                leased_by__name="gpu-flaky",
                lease_expires_at__gt=timezone.now(),
            )
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        if not held:  # nothing to lose: try again in a moment
            self.next_kill = time.monotonic() + 2
            return
        self.flaky.signal(signal.SIGKILL, group=True)
        self.flaky.kill()
        self.restart_at = time.monotonic() + RESTART_AFTER
        self.next_kill = time.monotonic() + self._kill_interval()
        jobs = ", ".join(str(pk) for pk in held)
        say(
            f"chaos: SIGKILLed worker gpu-flaky holding job(s) {jobs}; their leases "
            f"expire within {LEASE_SECONDS}s and are then reclaimed"
        )

    def report_reclaims(self) -> None:
        for line in self.reclaims.new_lines():
            say(line)

    def report_reruns(self) -> None:
        for line in self.reruns.new_lines():
            say(line)

    def report_progress(self) -> None:
        from batches.models import BatchCounter
        from engine import fleet
        from jobs import transitions

        c = BatchCounter.objects.all().totals()
        silent = fleet.silent_leases(transitions.now())
        states = ("queued", "transcribing", "done", "failed")
        total = sum(c[s] for s in states)
        hours = sum(c[f"{s}_ms"] for s in states) / 3.6e6
        now = time.monotonic()
        self.done_history.append((now, c["done_ms"] + c["failed_ms"]))
        self.done_history = [(t, ms) for t, ms in self.done_history if now - t <= 60]
        left = ""
        (t0, ms0), (t1, ms1) = self.done_history[0], self.done_history[-1]
        remaining = c["queued_ms"] + c["transcribing_ms"]
        if remaining and ms1 > ms0 and t1 > t0:
            minutes = remaining / ((ms1 - ms0) / (t1 - t0)) / 60
            eta = f"about {minutes:.0f} min" if minutes >= 1 else "under a minute"
            left = f" · {eta} left at the last minute's pace"
        quiet = f"{silent} silent (no heartbeat) · " if silent else ""
        say(
            f"progress: {c['done']}/{total} done · "
            f"{c['transcribing'] - silent} transcribing · {quiet}"
            f"{c['queued']} queued · {c['failed']} failed · audio "
            f"{c['done_ms'] / 3.6e6:.1f} of {hours:.1f} h{left}"
        )
        if routed := routed_progress():
            say(routed)
        # A batch that finished since the last tick is re-run first: the demo
        # is finished once every batch has finished and no re-run is pending.
        self.report_reruns()
        if (
            not self.finished
            and c["queued"] == 0
            and c["transcribing"] == 0
            and self.reruns.settled()
        ):
            self.finished = True
            say("every item is finished; Recall keeps running until Ctrl-C")

    def stop(self) -> None:
        """Workers first (their releases need the web server), then the rest.

        Each step is guarded: one child that will not stop cleanly is killed,
        and the others are still stopped.
        """
        self.restart_at = None
        for worker in self.workers.values():
            worker.terminate()  # all at once: they release in parallel
        steps = [(worker, 20.0) for worker in self.workers.values()]
        for child, timeout in (*steps, (self.web, 35.0), (self.cluster, 30.0)):
            try:
                stop(child, timeout)
            except Exception as error:
                say(f"could not stop {child.name} cleanly ({error!r}); killing it")
                with contextlib.suppress(Exception):
                    child.signal(signal.SIGKILL, group=True)

    def kill_all(self) -> None:
        for child in (*self.workers.values(), self.web, self.cluster):
            with contextlib.suppress(Exception):
                child.signal(signal.SIGKILL, group=True)


class Fatal(Exception):
    """Something the demo needs died: stop everything and say why."""


class ReclaimWatch:
    """Every reclaimed lease, reported once. Leases are numbered when claimed
    but reclaimed in the order they expire, so an older lease can be reclaimed
    after a newer one: the watch remembers which it reported (those reclaimed
    in the last few minutes; older ones were reported long ago)."""

    OUTCOMES = {
        "queued": "queued again",
        "leased": "queued again, and already claimed",
        "failed": "that was its last attempt, so it failed",
    }
    MEMORY = 300.0  # seconds of reclaims looked at again on every tick

    def __init__(self) -> None:
        self.reported: dict[int, datetime] = {}  # lease id -> ended_at

    def new_lines(self) -> list[str]:
        from jobs import transitions
        from jobs.models import Lease, LeaseEnd

        since = transitions.now() - timedelta(seconds=self.MEMORY)
        self.reported = {
            pk: ended for pk, ended in self.reported.items() if ended >= since
        }
        lines = []
        for lease in (
            Lease.objects.filter(end_reason=LeaseEnd.EXPIRED, ended_at__gte=since)
            .exclude(pk__in=list(self.reported))
            .select_related("worker", "job")
            .order_by("ended_at", "pk")
        ):
            self.reported[lease.pk] = lease.ended_at
            outcome = self.OUTCOMES.get(lease.job.status, f"now {lease.job.status}")
            lines.append(
                f"reclaimed job {lease.job_id}: {lease.worker.name}'s lease (attempt "
                f"{lease.attempt}) expired; {outcome}"
            )
        return lines


def main() -> int:
    configure_environment()
    fresh_database()
    password, tokens = set_up()  # no children yet: Ctrl-C here just ends it
    demo = Demo(tokens)

    def on_signal(signum: int, frame: object) -> None:
        """First signal: stop in order (the main loop sees the flag). Second:
        kill everything now."""
        if demo.stop_requested:
            say("second signal: killing everything now")
            demo.kill_all()
            os._exit(130)
        demo.stop_requested = True

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    status = 1
    try:
        say("starting gunicorn and the django-q2 cluster ...")
        demo.start()
        if not demo.stop_requested:
            banner(demo.url, password)
        while not demo.stop_requested:
            demo.tick()
            time.sleep(0.5)
        status = 0
    except Fatal as error:
        say(str(error))
    finally:  # whatever went wrong, nothing this started is left running
        demo.stop_requested = True
        say("stopping: workers (releasing their leases), web server, cluster ...")
        demo.stop()
        say("stopped")
    return status


def banner(url: str, password: str) -> None:
    with contextlib.suppress(OSError):
        print(
            f"\n  Recall demo: {url}/\n"
            f"  Login: {ADMIN} / {password}   (demo only)\n"
            f"  Leases last {LEASE_SECONDS}s. Three simulated workers run 2 jobs "
            f"each; gpu-flaky is SIGKILLed about every {KILL_EVERY:g}s.\n"
            f"  Routing: {routing_sentence()}.\n"
            f"  Re-run: each batch that finishes with transcripts flagged "
            f"{RERUN_FLAG} has them re-run once on {pairs(RERUN_REQUIRES)}.\n"
            f"  Logs: var/demo/logs/   Ctrl-C stops everything.\n"
            f"  Operator API: RECALL_URL={url} "
            f"RECALL_API_TOKEN=$(cat var/demo/api_token) \\\n"
            f"    python3 worker/recallctl.py submit var/demo/pipeline.csv --wait\n",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
