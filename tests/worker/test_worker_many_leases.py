"""The reference worker's calls for many leases, as a real subprocess against a
small fake server: one claim fills every free slot (``max_jobs``) and carries
the worker's labels, one batched heartbeat per interval renews every lease, a
lease the batch answers lost stops only its own engine, and against a server
that refuses those forms the worker falls back to the single ones and keeps
to them. Its labels follow the server's rules. No database: these also run in
the SQLite pass. (Against the real server: tests/worker/test_worker_live.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from batches.labels import LabelError, parse_pairs
from tests.support.worker import WORKER_SCRIPT, load_worker_module

TOKEN = "wtok-" + "M4nyL34s" * 5
SECONDS_OF_WORK = 2.0  # each job's (simulated) engine time
rw = load_worker_module()


class FakeServer:
    """A worker API with ``jobs`` jobs to hand out, as new (``many=True``: it
    takes ``max_jobs`` and the batched heartbeat) or as an older server that
    answers 400 to ``max_jobs`` (``strict``) or ignores it, and 404 to the
    batched heartbeat. ``lost``: job ids whose leases a heartbeat finds lost.
    Every request is recorded as (path, body)."""

    def __init__(self, jobs: int, *, many: bool, strict: bool = False):
        self.many, self.strict = many, strict
        self.queue = list(range(1, jobs + 1))
        self.lost: set[int] = set()
        self.beats_fail = False  # every batched heartbeat answers 503
        self.lease_seconds = 60
        self.requests: list[tuple[str, dict]] = []
        self.completed: list[int] = []
        self.complete_delay = 0.0  # each completion's answer comes this late
        self.lost_on_complete: set[int] = set()  # lost only when completed
        self.old_complete_status = 404  # an older server's answer to /complete
        self.lock = threading.Lock()

    def job(self, job_id: int) -> dict:
        return {
            "id": job_id,
            "lease_token": f"lease-{job_id}-" + "x" * 20,
            "lease_expires_at": "2026-01-01T12:01:00+00:00",
            "lease_seconds": self.lease_seconds,
            "heartbeat_interval": 0.5,
            "attempt": 1,
            "max_attempts": 3,
            "batch": {"id": 1, "name": "fake"},
            "item": {
                "id": job_id,
                "source": f"file:///audio/{job_id}.wav",
                "params": {},
                "duration_seconds": SECONDS_OF_WORK,
            },
        }

    def answer(self, path: str, body: dict) -> tuple[int, dict | None]:
        with self.lock:
            self.requests.append((path, body))
            if path == "/api/v1/claim":
                if "max_jobs" in body and not self.many and self.strict:
                    return 400, {"error": "bad_request", "detail": "max_jobs?"}
                wanted = body.get("max_jobs", 1) if self.many else 1
                taken, self.queue = self.queue[:wanted], self.queue[wanted:]
                if not taken:
                    return 204, None
                if self.many and "max_jobs" in body:
                    return 200, {"jobs": [self.job(j) for j in taken]}
                return 200, {"job": self.job(taken[0])}
            if path == "/api/v1/heartbeat":
                if not self.many:
                    return 404, {"error": "not_found", "detail": "No endpoint."}
                if self.beats_fail:
                    return 503, {"error": "unavailable", "detail": "Try later."}
                return 200, {
                    "leases": [
                        {"job_id": lease["job_id"], "error": "lease_lost"}
                        if lease["job_id"] in self.lost
                        else {
                            "job_id": lease["job_id"],
                            "lease_expires_at": "2026-01-01T12:01:00+00:00",
                        }
                        for lease in body["leases"]
                    ]
                }
            if path == "/api/v1/complete":
                if not self.many:
                    status = self.old_complete_status
                    return status, {"error": "not_found", "detail": "No endpoint."}
                answers = []
                for entry in body["results"]:
                    if entry["job_id"] in self.lost | self.lost_on_complete:
                        answers.append(
                            {"job_id": entry["job_id"], "error": "lease_lost"}
                        )
                    else:
                        self.completed.append(entry["job_id"])
                        answers.append(
                            {"job_id": entry["job_id"], "status": "completed"}
                        )
                return 200, {"results": answers}
            if match := re.fullmatch(r"/api/v1/jobs/(\d+)/(\w+)", path):
                job_id, action = int(match[1]), match[2]
                if action == "heartbeat" and job_id in self.lost:
                    return 409, {"error": "lease_lost", "detail": "Not yours."}
                if action == "complete":
                    if job_id in self.lost | self.lost_on_complete:
                        return 409, {"error": "lease_lost", "detail": "Not yours."}
                    self.completed.append(job_id)
                    return 200, {"status": "completed"}
                return 200, {"lease_expires_at": "2026-01-01T12:01:00+00:00"}
            return 404, {"error": "not_found", "detail": path}

    def calls(self, path: str) -> list[dict]:
        with self.lock:
            return [body for p, body in self.requests if p == path]

    def single_heartbeats(self) -> list[str]:
        with self.lock:
            return [
                p
                for p, _ in self.requests
                if p.endswith("/heartbeat") and "/jobs/" in p
            ]


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fake = self.server.fake  # type: ignore[attr-defined]
        if "complete" in self.path and fake.complete_delay:
            time.sleep(fake.complete_delay)  # a slow answer: others end meanwhile
        status, body = self.server.fake.answer(self.path, json.loads(raw or b"{}"))  # type: ignore[attr-defined]
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve(tmp_path):
    """``serve(fake, *options)``: the fake server up, a worker started on it."""
    servers: list[ThreadingHTTPServer] = []
    workers: list[subprocess.Popen] = []

    def start(fake: FakeServer, *options: str, env: dict | None = None):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.fake = fake  # type: ignore[attr-defined]
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        log = tmp_path / f"worker-{len(workers)}.log"
        proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), "--simulate",
             "--simulate-factor=1", "--wait-seconds=0", "--poll-min=0.1",
             "--poll-max=0.2", f"--url=http://127.0.0.1:{server.server_port}",
             *options],
            env={"PATH": os.environ["PATH"], "RECALL_TOKEN": TOKEN, **(env or {})},
            stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True,
        )  # fmt: skip
        proc.log_path = log  # type: ignore[attr-defined]
        workers.append(proc)
        return proc

    yield start
    for proc in workers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    for server in servers:
        server.shutdown()


def until(condition, proc, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            log = Path(proc.log_path).read_text(errors="replace")
            pytest.fail(f"timed out waiting for {what}\n{log}")
        time.sleep(0.05)
    return value


def test_one_claim_fills_every_slot_and_one_call_renews_every_lease(serve):
    fake = FakeServer(4, many=True)
    proc = serve(
        fake, "--concurrency=4", "--label", "model=large-v3", "--label=gpu=a100"
    )

    until(lambda: len(fake.completed) == 4, proc, "the 4 jobs completed")

    claims = fake.calls("/api/v1/claim")
    assert claims[0] == {"max_jobs": 4, "labels": {"gpu": "a100", "model": "large-v3"}}
    assert all(claim["labels"] == claims[0]["labels"] for claim in claims)
    beats = fake.calls("/api/v1/heartbeat")
    # 2 s of work, a heartbeat interval of 0.5 s: a few calls, each for every
    # lease (16 or so single heartbeats would have been sent one by one).
    assert 2 <= len(beats) <= 6, beats
    assert [lease["job_id"] for lease in beats[0]["leases"]] == [1, 2, 3, 4]
    assert all(
        set(lease) == {"job_id", "lease_token"} for b in beats for lease in b["leases"]
    )
    assert fake.single_heartbeats() == []
    assert sorted(fake.completed) == [1, 2, 3, 4]


def test_free_slots_are_filled_as_they_free_up(serve):
    fake = FakeServer(5, many=True)
    proc = serve(fake, "--concurrency=3")

    until(lambda: len(fake.completed) == 5, proc, "the 5 jobs completed")

    asked = [claim["max_jobs"] for claim in fake.calls("/api/v1/claim")]
    assert asked[0] == 3
    assert set(asked) <= {1, 2, 3}
    assert "labels" not in fake.calls("/api/v1/claim")[0]  # none declared


def test_a_lease_answered_lost_stops_only_its_own_engine(serve):
    fake = FakeServer(3, many=True)
    fake.lost = {2}
    proc = serve(fake, "--concurrency=3")

    until(lambda: len(fake.completed) == 2, proc, "the two live jobs completed")
    until(
        lambda: "job=2 attempt=1/3 abandoned" in Path(proc.log_path).read_text(),
        proc,
        "job 2 abandoned",
    )

    log = Path(proc.log_path).read_text()
    assert "job=2 attempt=1/3 lease lost on heartbeat: stopping the engine" in log
    assert sorted(fake.completed) == [1, 3]


def test_it_warns_once_per_lease_when_no_batched_heartbeat_is_accepted(serve):
    """The server cannot renew the leases for longer than a lease: the worker
    says so once per lease, as the single heartbeat does, and works on."""
    fake = FakeServer(2, many=True)
    fake.beats_fail, fake.lease_seconds = True, 1
    proc = serve(fake, "--concurrency=2")

    until(lambda: len(fake.completed) == 2, proc, "the 2 jobs completed")

    log = Path(proc.log_path).read_text()
    for job_id in (1, 2):
        warnings = re.findall(
            rf"job={job_id} attempt=1/3 no heartbeat accepted for \d+s \(lease 1s\)",
            log,
        )
        assert len(warnings) == 1, log
    assert sorted(fake.completed) == [1, 2]


@pytest.mark.parametrize("strict", [True, False], ids=["refuses", "ignores"])
def test_against_an_older_server_it_falls_back_to_the_single_forms(serve, strict):
    """An older server answers 400 to max_jobs (or ignores it and hands out
    one job) and 404 to the batched heartbeat: the worker claims one job per
    call and heartbeats each lease alone, and does not ask again."""
    fake = FakeServer(3, many=False, strict=strict)
    proc = serve(fake, "--concurrency=3")

    until(lambda: len(fake.completed) == 3, proc, "the 3 jobs completed")

    claims = fake.calls("/api/v1/claim")
    with_max = [claim for claim in claims if "max_jobs" in claim]
    if strict:
        assert with_max == [{"max_jobs": 3}]  # refused once, then single claims
        assert (
            "claiming one job per call from now on" in Path(proc.log_path).read_text()
        )
    else:
        assert len(with_max) == len(claims)  # ignored: always answered one job
    assert len(fake.calls("/api/v1/heartbeat")) == 1  # 404 once, remembered
    assert len(fake.single_heartbeats()) >= 3
    assert sorted(fake.completed) == [1, 2, 3]


def test_results_that_end_together_go_in_one_batched_completion(serve):
    """Four jobs end together while the first result's answer is slow: the
    first is reported alone (at once), the three that ended meanwhile in one
    batched completion; each job is completed once."""
    fake = FakeServer(4, many=True)
    fake.complete_delay = 0.5
    proc = serve(fake, "--concurrency=4")

    until(lambda: len(fake.completed) == 4, proc, "the 4 jobs completed")

    batched = fake.calls("/api/v1/complete")
    singles = [p for p, _ in fake.requests if p.endswith("/complete") and "/jobs/" in p]
    assert [len(call["results"]) for call in batched] == [3], batched
    assert len(singles) == 1
    entries = batched[0]["results"]
    assert all(set(e) == {"job_id", "lease_token", "result"} for e in entries)
    assert all(e["lease_token"] == f"lease-{e['job_id']}-" + "x" * 20 for e in entries)
    assert all(isinstance(e["result"]["text"], str) for e in entries)
    assert sorted(fake.completed) == [1, 2, 3, 4]

    # The server counts a completion when its request arrives; the worker logs
    # it once the answer is back, a moment later.
    def logged() -> list[str]:
        return re.findall(r"attempt=1/3 completed in", Path(proc.log_path).read_text())

    until(lambda: len(logged()) >= 4, proc, "the 4 completions logged")
    assert len(logged()) == 4


def test_a_result_answered_lost_in_a_batch_is_discarded_alone(serve):
    fake = FakeServer(4, many=True)
    fake.complete_delay = 0.5
    fake.lost_on_complete = {3}
    proc = serve(fake, "--concurrency=4")

    until(lambda: len(fake.completed) == 3, proc, "the 3 live jobs completed")
    until(
        lambda: (
            "job=3 attempt=1/3 result discarded: lease lost"
            in Path(proc.log_path).read_text()
        ),
        proc,
        "job 3's result discarded",
    )

    assert sorted(fake.completed) == [1, 2, 4]
    assert fake.calls("/api/v1/complete")  # (3 was in a batch, or alone)


@pytest.mark.parametrize("status", [404, 400])
def test_against_an_older_server_it_completes_each_job_alone(serve, status):
    """An older server answers 404 (no such path) or 400 to the batched
    completion: the results of that batch are reported one by one, and the
    worker does not ask again."""
    fake = FakeServer(4, many=False)
    fake.complete_delay, fake.old_complete_status = 0.3, status
    proc = serve(fake, "--concurrency=4")

    until(lambda: len(fake.completed) == 4, proc, "the 4 jobs completed")

    assert len(fake.calls("/api/v1/complete")) == 1  # refused once, remembered
    assert sorted(fake.completed) == [1, 2, 3, 4]
    log = Path(proc.log_path).read_text()
    assert "completing each job on its own from now on" in log


def test_labels_from_the_environment(serve):
    fake = FakeServer(1, many=True)
    proc = serve(fake, env={"RECALL_WORKER_LABELS": "gpu=a100, model=large-v3"})

    until(lambda: fake.completed, proc, "the job completed")

    assert fake.calls("/api/v1/claim")[0]["labels"] == {
        "gpu": "a100",
        "model": "large-v3",
    }


def test_the_command_line_labels_win_over_the_environment(serve):
    fake = FakeServer(1, many=True)
    proc = serve(fake, "--label=gpu=h100", env={"RECALL_WORKER_LABELS": "gpu=a100"})

    until(lambda: fake.completed, proc, "the job completed")

    assert fake.calls("/api/v1/claim")[0]["labels"] == {"gpu": "h100"}


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        (["--label=gpu"], {}, "'gpu' is not KEY=VALUE"),
        (["--label=GPU=a100"], {}, "key 'GPU' must be"),
        (["--label=gpu=a 100"], {}, "value of 'gpu' must be"),
        (["--label=gpu=a", "--label=gpu=b"], {}, "'gpu' is given twice"),
        ([], {"RECALL_WORKER_LABELS": "gpu=a100,model="}, "value of 'model' must be"),
        ([f"--label=k{n}=v" for n in range(17)], {}, "at most 16 labels, got 17"),
    ],
)
def test_bad_labels_are_refused_at_start_up(options, env, message):
    result = subprocess.run(
        [sys.executable, str(WORKER_SCRIPT), "--simulate", "--url=http://x",
         f"--token={TOKEN}", *options],
        capture_output=True, text=True, timeout=30,
        env={"PATH": os.environ["PATH"], **env},
    )  # fmt: skip

    assert result.returncode == 2
    assert "--label: " in result.stderr and message in result.stderr


LABEL_CASES = [
    [],
    ["gpu=a100"],
    ["gpu=a100", "model=large-v3"],
    [" gpu = a100 ", ""],
    ["z.9_-=A-z_.:/9"],
    ["gpu"],
    ["=a100"],
    ["gpu="],
    ["Gpu=a100"],
    ["-gpu=a100"],
    ["_gpu=a100"],
    ["gpu=a100", "gpu=h100"],
    ["gpu=a 100"],
    ["gpu=a100!"],
    ["gpu=" + "v" * 63],
    ["gpu=" + "v" * 64],
    ["k" * 63 + "=v"],
    ["k" * 64 + "=v"],
    ["gpu=é"],
    [f"k{n}=v" for n in range(16)],
    [f"k{n}=v" for n in range(17)],
    ["a=b=c"],
]


@pytest.mark.parametrize("pairs", LABEL_CASES)
def test_the_worker_and_the_server_read_labels_alike(pairs):
    """The worker repeats the server's label rules (it runs without Recall):
    both accept the same pairs, as the same labels, and refuse the same."""
    try:
        server = parse_pairs(pairs)
    except LabelError:
        server = None
    try:
        worker = rw.parse_labels(pairs)
    except ValueError:
        worker = None

    assert worker == server
