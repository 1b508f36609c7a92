#!/usr/bin/env python3
"""Recall reference worker: claims transcription jobs from Recall and runs them.

One file, Python 3.11+, standard library only: copy it onto any machine that can
reach Recall and run it. It claims jobs (as many in one call as it has free
slots, declaring its ``--label`` s), runs the transcription engine on each,
heartbeats all its leases in one call per interval on a background thread
while the engines work, and completes or fails each job; forever, until it is
stopped. Against a server without those calls for many leases it uses the
single ones. Run ``recall_worker.py --help`` for
every option; Recall's docs/reference/worker.md explains the rest.

Guarantees it keeps, and why:

* A lease the server took back (409 ``lease_lost``) is never completed: the
  engine is killed at once, its result thrown away, and the worker moves on.
* SIGTERM or SIGINT kills the engine and releases the lease through the API, so
  the job is queued again at once instead of waiting for the lease to expire;
  then the worker exits 0. A second signal exits at once.
* Network errors, 5xx and 429 are retried with jittered exponential backoff,
  never sooner than the server's Retry-After asks (seconds or an HTTP date:
  a 429 ``rate_limited`` or ``too_many_leases``, a 503), on every call; a
  completion is retried until the server answers 200 or 409 (completing is
  idempotent for the same lease token, so a lost response costs nothing).
* An idle worker long-polls: each claim asks the server to wait up to
  ``--wait-seconds`` for work, so a new batch is picked up within a second. A
  server that answers an empty queue (204) sooner than that (an older server,
  or one that cannot hold requests) is polled with jittered backoff up to a
  cap, so a fleet of idle workers does not hammer it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import email.utils
import functools
import ipaddress
import json
import logging
import math
import os
import random
import re
import shlex
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any

__version__ = "1.0.0"

API_PREFIX = "/api/v1"

# The worker's own exit statuses.
EXIT_STOPPED = 0  # stopped by SIGTERM/SIGINT, leases released
EXIT_USAGE = 2  # bad command line (argparse's convention)
EXIT_REFUSED = 3  # the server refused this worker (401/403, wrong URL): not transient
# A second signal exits at once with 128 + the signal number, like a shell.

# Engine exit statuses that mean "this input will never work", so the job fails
# for good instead of being retried: sysexits.h's EX_DATAERR (the input data is
# wrong: not audio, unsupported format) and EX_NOINPUT (the input does not
# exist or cannot be read). Every other non-zero status is retryable.
DEFAULT_NON_RETRYABLE_EXIT_CODES = "65,66"

# The server keeps errors up to 10,000 characters; send less, so the body is
# always small and valid.
MAX_ERROR_CHARS = 4_000
STDERR_TAIL_BYTES = 16 * 1024
MAX_STDOUT_BYTES = 64 * 1024 * 1024
MAX_RESPONSE_BYTES = 1024 * 1024
# Retry-After is honoured, up to this.
MAX_RETRY_AFTER_SECONDS = 300.0
# The server's bound on segment times (seconds).
MAX_SEGMENT_SECONDS = 10_000_000
# The server refuses a body nesting arrays and objects deeper than this.
MAX_JSON_DEPTH = 32

# Calls for many leases at once: the most leases one batched heartbeat names
# (the server's limit), and the most jobs one claim asks for.
MAX_HEARTBEAT_LEASES = 64
MAX_CLAIM_JOBS = 32
# The most results one batched completion carries (the server's limit).
MAX_COMPLETIONS = 64

# Environment variables the engine subprocess must not inherit (its token).
PRIVATE_ENV_PREFIXES = ("RECALL_TOKEN", "RECALL_WORKER_")

log = logging.getLogger("recall.worker")


# --- Logs never show a token ----------------------------------------------------

REDACTED = "[redacted]"
# A token next to its name, however it was printed: JSON, a dict's repr, a header.
_TOKEN_PATTERNS = (
    re.compile(r"""(["']?lease_token["']?\s*[:=]\s*["']?)([^"'\s,}]+)"""),
    re.compile(r"(Bearer\s+)([^\s\"',}]+)", re.IGNORECASE),
)


class Redactor(logging.Filter):
    """Removes the worker's token and every lease token from log records.

    Installed on the log handler, so no line can show one, whatever logged it:
    a message, its arguments, an exception's traceback. Known tokens are
    replaced wherever they appear, and anything labelled as a token is too.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._secrets: set[str] = set()

    def add(self, secret: str) -> None:
        if secret:
            with self._lock:
                self._secrets.add(secret)

    def discard(self, secret: str) -> None:
        with self._lock:
            self._secrets.discard(secret)

    def redact(self, text: str) -> str:
        with self._lock:
            secrets = sorted(self._secrets, key=len, reverse=True)
        for secret in secrets:
            text = text.replace(secret, REDACTED)
        for pattern in _TOKEN_PATTERNS:
            text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.redact(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


REDACTOR = Redactor()


def configure_logging(level: str, token: str) -> None:
    """Log to stderr, one line per event, with every token redacted."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s [%(threadName)s] %(message)s",
        stream=sys.stderr,
    )
    REDACTOR.add(token)
    for handler in logging.getLogger().handlers:
        handler.addFilter(REDACTOR)


def plain_http_warning(url: str) -> str | None:
    """A warning when ``url`` sends the token in clear text over a network."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http":
        return None
    host = (parsed.hostname or "").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return None
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return None
    return (
        f"RECALL_URL is plain http:// to {host!r}, which is not this machine: the "
        f"worker token and every transcript cross the network unencrypted; use "
        f"https://"
    )


def safe_url(url: str) -> str:
    """``url`` without a password, for logs."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.password is None:
        return url
    netloc = f"{parsed.username}:{REDACTED}@{parsed.hostname}"
    if parsed.port is not None:
        netloc += f":{parsed.port}"
    return urllib.parse.urlunsplit(parsed._replace(netloc=netloc))


# --- Labels -----------------------------------------------------------------------
#
# The server's rules for labels (Recall's batches/labels.py), repeated here
# because this file runs alone, without Recall installed; a test checks that
# both accept and refuse the same labels.

LABEL_KEY = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
LABEL_VALUE = re.compile(r"[A-Za-z0-9_.:/-]{1,63}")
MAX_LABELS = 16


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """``["gpu=a100", "model=large-v3"]`` as labels; ValueError saying what is
    wrong for a pair without ``=``, a key given twice, a bad key or value, or
    more than MAX_LABELS labels."""
    labels: dict[str, str] = {}
    for pair in pairs:
        pair = pair.strip()
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ValueError(f"{pair!r} is not KEY=VALUE")
        if key in labels:
            raise ValueError(f"{key!r} is given twice")
        if not LABEL_KEY.fullmatch(key):
            raise ValueError(
                f"key {key!r} must be 1 to 63 characters of a-z, 0-9, '_', '.' "
                "and '-', starting with a letter or digit"
            )
        if not LABEL_VALUE.fullmatch(value):
            raise ValueError(
                f"value of {key!r} must be 1 to 63 characters of A-Z, a-z, 0-9 "
                "and '_.:/-'"
            )
        labels[key] = value
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels, got {len(labels)}")
    return dict(sorted(labels.items()))


# --- Errors ---------------------------------------------------------------------


class ApiError(Exception):
    """The server answered, and the answer means this call will not succeed."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class LeaseLost(ApiError):
    """409: the lease is not ours any more. Stop working on the job."""


class Refused(ApiError):
    """401/403, a redirect, or no API at the URL: no retry can fix this worker."""


class Rejected(ApiError):
    """Any other 4xx: this request is wrong (e.g. a result too large, 413)."""


class Transient(Exception):
    """A network error, a 5xx or a 429: worth retrying after a pause."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class GaveUp(Exception):
    """A retry loop stopped because its caller no longer wants the answer."""


# --- Backoff --------------------------------------------------------------------


def backoff_delay(attempt: int, *, base: float, cap: float) -> float:
    """Jittered exponential backoff ("equal jitter") for retry number ``attempt``.

    Half the delay is fixed, half random, so retries spread out (no thundering
    herd after an outage) but never come back too soon.
    """
    # The exponent is bounded: a worker idle for days polls thousands of times,
    # and 2.0 ** 1024 overflows a float.
    delay = min(cap, base * 2.0 ** min(max(attempt - 1, 0), 60))
    return delay / 2 + random.uniform(0, delay / 2)


def pause(seconds: float, interrupted: Callable[[], bool]) -> bool:
    """Sleep up to ``seconds``; return False early when ``interrupted()`` says so.

    Sleeping in short slices lets one signal wake every thread within a fraction
    of a second without a web of events.
    """
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if interrupted():
            return False
        time.sleep(min(0.1, left))
    return not interrupted()


# --- The API client -------------------------------------------------------------


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """urllib would turn a redirected POST into a GET without a body: refuse."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class Api:
    """Worker API v1 over HTTP(S): a POST, its answer classified, and retries."""

    def __init__(self, url: str, token: str, *, timeout: float, retry_cap: float):
        self.base = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.retry_cap = retry_cap
        self._opener = urllib.request.build_opener(_NoRedirects)

    # One attempt.

    def post(
        self, path: str, body: dict, *, timeout: float | None = None
    ) -> tuple[int, dict | None]:
        """POST ``body`` once; return (status, JSON) on 2xx or raise an error."""
        data = json.dumps(body, allow_nan=False, ensure_ascii=False).encode("utf-8")
        request = urllib.request.Request(
            self.base + API_PREFIX + path,
            data=data,
            method="POST",
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
                "User-Agent": f"recall-worker/{__version__}",
            },
        )
        try:
            with self._opener.open(request, timeout=timeout or self.timeout) as resp:
                status, raw = resp.status, resp.read(MAX_RESPONSE_BYTES)
        except urllib.error.HTTPError as error:
            raise self._classify(error) from None
        except (urllib.error.URLError, HTTPException, OSError, ValueError) as error:
            reason = getattr(error, "reason", None) or error
            raise Transient(f"network error: {reason}") from None
        if status == 204 or not raw.strip():
            return status, None
        try:
            payload = json.loads(raw)
        except ValueError:
            raise Transient(f"HTTP {status} with a body that is not JSON") from None
        return status, payload if isinstance(payload, dict) else None

    def _classify(self, error: urllib.error.HTTPError) -> Exception:
        status = error.code
        try:
            payload = json.loads(error.read(MAX_RESPONSE_BYTES) or b"{}")
        except (ValueError, OSError):
            payload = {}
        if not isinstance(payload, dict):
            payload = {}
        code = str(payload.get("error", "")) or "http_error"
        detail = str(payload.get("detail", "")) or str(error.reason)
        if 300 <= status < 400:
            location = error.headers.get("Location", "?")
            return Refused(
                status,
                "redirect",
                f"the server redirects to {location}; set the URL to that address",
            )
        if status in (401, 403):
            return Refused(status, code, detail)
        if status == 409:
            return LeaseLost(status, code, detail)
        if status in (408, 425, 429) or status >= 500:
            return Transient(
                f"HTTP {status} {code}: {detail}",
                retry_after=_retry_after(error.headers.get("Retry-After")),
            )
        return Rejected(status, code, detail)

    # With retries.

    def call(
        self,
        path: str,
        body: dict,
        *,
        what: str,
        give_up: Callable[[], bool],
        cap: float | None = None,
        timeout: float | None = None,
    ) -> tuple[int, dict | None]:
        """POST, retrying transient errors with backoff until ``give_up()``.

        Raises GaveUp when ``give_up()`` turns true between attempts, and lets
        every non-transient error through to the caller, who knows what it means.
        """
        cap = self.retry_cap if cap is None else cap
        attempt = 0
        while True:
            try:
                return self.post(path, body, timeout=timeout)
            except Transient as error:
                attempt += 1
                if give_up():
                    raise GaveUp(str(error)) from None
                delay = backoff_delay(attempt, base=0.5, cap=cap)
                if error.retry_after is not None:
                    delay = max(delay, error.retry_after)
                log.warning(
                    "%s failed (%s); retry %d in %.1fs", what, error, attempt, delay
                )
                if not pause(delay, give_up):
                    raise GaveUp(str(error)) from None


def _retry_after(value: str | None, now: float | None = None) -> float | None:
    """The seconds a Retry-After header asks to wait: delay-seconds or an
    HTTP date (RFC 9110; one in the past is no wait), up to
    MAX_RETRY_AFTER_SECONDS; None if there is none or it makes no sense."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:  # "-0000": UTC, says RFC 5322
            when = when.replace(tzinfo=datetime.UTC)
        at = time.time() if now is None else now
        seconds = max(0.0, when.timestamp() - at)
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_SECONDS)


# --- Jobs and what engines return ----------------------------------------------


@dataclass(frozen=True)
class Job:
    """A claimed job, as the claim response described it."""

    id: int
    lease_token: str
    lease_seconds: float
    heartbeat_interval: float
    attempt: int
    max_attempts: int
    batch_id: int | None
    batch_name: str
    item_id: int | None
    source: str
    params: dict
    duration: float | None
    # With --source-root: the real path the source was checked as (the engine
    # gets this one, so what was checked is what is opened).
    local_path: str | None = None

    @classmethod
    def from_claim(cls, payload: dict) -> Job:
        job = payload["job"]
        batch = job.get("batch") or {}
        item = job.get("item") or {}
        lease_seconds = float(job.get("lease_seconds") or 60)
        interval = float(job.get("heartbeat_interval") or lease_seconds / 3)
        duration = item.get("duration_seconds")
        return cls(
            id=int(job["id"]),
            lease_token=str(job["lease_token"]),
            lease_seconds=lease_seconds,
            heartbeat_interval=max(0.5, interval),
            attempt=int(job.get("attempt") or 1),
            max_attempts=int(job.get("max_attempts") or 1),
            batch_id=batch.get("id"),
            batch_name=str(batch.get("name", "")),
            item_id=item.get("id"),
            source=str(item.get("source", "")),
            params=item.get("params") if isinstance(item.get("params"), dict) else {},
            duration=float(duration) if _is_number(duration) else None,
        )

    @property
    def tag(self) -> str:
        """What every log line about this job starts with."""
        return f"job={self.id} attempt={self.attempt}/{self.max_attempts}"


@dataclass(frozen=True)
class Success:
    result: dict


@dataclass(frozen=True)
class Failure:
    error: str
    retryable: bool = True


@dataclass(frozen=True)
class Aborted:
    """The engine was stopped on purpose (lease lost, or shutting down)."""

    reason: str


Outcome = Success | Failure | Aborted


class Cancellation:
    """Stops one job's engine from any thread: sets a flag, runs kill hooks once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._hooks: list[Callable[[], None]] = []
        self.reason = ""

    def cancel(self, reason: str) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` on cancel (now, if already cancelled)."""
        with self._lock:
            if not self._event.is_set():
                self._hooks.append(hook)
                return
        hook()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if cancelled meanwhile."""
        return self._event.wait(seconds)


# --- Results: never send the server a body it must refuse ------------------------


def clean_text(value: Any, limit: int | None = None) -> str:
    """A string the server accepts: no NUL, no unpaired surrogates, maybe capped.

    Capping keeps the end (for stderr, the last lines say what went wrong).
    """
    text = value if isinstance(value, str) else str(value)
    text = text.replace("\x00", "")
    text = text.encode("utf-8", "replace").decode("utf-8")
    if limit is not None and len(text) > limit:
        text = "[…]" + text[-(limit - 3) :]
    return text


def _is_number(value: Any) -> bool:
    """A finite number that fits a float (JSON integers have no size: an
    engine's 10**400 would overflow ``math.isfinite`` and ``float``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _clean_json(value: Any, depth: int) -> Any:
    """Any JSON value made safe: clean strings, no NaN/Infinity, and null for
    an array or object the server would find nested too deep (``depth``: the
    level ``value`` has in the completion's body)."""
    if isinstance(value, dict | list | tuple) and depth > MAX_JSON_DEPTH:
        return None
    if isinstance(value, dict):
        return {clean_text(k): _clean_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean_json(v, depth + 1) for v in value]
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float):
        return value
    return clean_text(value)


def normalize_result(data: Any) -> dict:
    """Shape an engine's output into a result the server accepts.

    ``text`` becomes a string (joined from the segments if missing);
    ``segments`` keep ``start``, ``end`` (seconds, rounded to ms, 0 <= start <=
    end <= MAX_SEGMENT_SECONDS: a later end is capped) and ``text``, and are
    dropped when unusable or starting later; ``language`` is kept if it
    is a string. Other top-level fields are kept, cleaned. Raises ValueError when
    there is nothing that looks like a transcript.
    """
    if isinstance(data, str):
        return {"text": clean_text(data)}
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    segments = _clean_segments(data.get("segments"))
    if isinstance(data.get("text"), str):
        text = clean_text(data["text"])
    elif segments is not None:
        text = " ".join(s["text"].strip() for s in segments if s["text"].strip())
    else:
        raise ValueError("the JSON has neither 'text' nor 'segments'")
    result = {
        # {"lease_token", "result": {k: v}}: v is on the body's third level.
        k: _clean_json(v, 3)
        for k, v in data.items()
        if k not in ("text", "segments", "language")
    }
    result["text"] = text
    if segments is not None:
        result["segments"] = segments
    if isinstance(data.get("language"), str):
        result["language"] = clean_text(data["language"])
    return result


def _clean_segments(raw: Any) -> list[dict] | None:
    if not isinstance(raw, list):
        return None
    segments = []
    for segment in raw:
        if not isinstance(segment, dict):
            continue
        start, end = segment.get("start"), segment.get("end")
        if not (_is_number(start) and _is_number(end)):
            continue
        if start > MAX_SEGMENT_SECONDS:
            continue
        start = round(max(0.0, float(start)), 3)
        end = round(max(start, float(min(end, MAX_SEGMENT_SECONDS))), 3)
        text = segment.get("text")
        segments.append({"start": start, "end": end, "text": clean_text(text or "")})
    return segments


def parse_output(stdout: bytes, outdir: str) -> dict:
    """The engine's result, from the files it wrote or from what it printed.

    In order: a ``*.json`` file in the output directory (``result.json`` first,
    then the others by name), JSON printed on stdout (the whole of it, or its
    last line), plain text printed on stdout, a ``*.txt`` file in the output
    directory. Raises ValueError when the engine produced none of them, or
    malformed JSON.
    """
    files = sorted(os.listdir(outdir))
    for name in sorted(
        (n for n in files if n.endswith(".json")), key=lambda n: n != "result.json"
    ):
        with open(os.path.join(outdir, name), "rb") as f:
            try:
                data = json.loads(f.read())
            except ValueError as error:
                raise ValueError(f"{name} is not valid JSON: {error}") from None
            except RecursionError:
                raise ValueError(f"{name} is nested too deeply") from None
        return normalize_result(data)
    text = stdout.decode("utf-8", "replace")
    if text.strip():
        stripped = text.strip()
        candidates = [stripped, stripped.splitlines()[-1]]
        for candidate in candidates:
            if candidate.startswith("{"):
                try:
                    return normalize_result(json.loads(candidate))
                except (ValueError, RecursionError):
                    continue
        return {"text": clean_text(stripped)}
    for name in (n for n in files if n.endswith(".txt")):
        with open(os.path.join(outdir, name), encoding="utf-8", errors="replace") as f:
            return {"text": clean_text(f.read().strip())}
    raise ValueError(
        "the engine exited 0 but wrote no result (no JSON or text file in the "
        "output directory, nothing on stdout); a silent file should still "
        'produce {"text": ""}'
    )


# --- Engines ----------------------------------------------------------------------


class Engine:
    """Turns one job into an Outcome; must stop promptly when cancelled."""

    name = "engine"

    def run(self, job: Job, cancel: Cancellation) -> Outcome:
        raise NotImplementedError


class _Params:
    """``{params}`` formats as JSON; ``{params[name]}`` as that one value."""

    def __init__(self, params: dict):
        self.params = params

    def __format__(self, spec: str) -> str:
        return json.dumps(self.params, ensure_ascii=False)

    def __getitem__(self, key: str) -> str:
        if key not in self.params:
            raise MissingParam(key)
        value = self.params[key]
        return value if isinstance(value, str) else json.dumps(value)


class MissingParam(KeyError):
    """The command template needs a param this item does not have."""


class UnsafeArgument(ValueError):
    """A value the command line would get that an engine could take for an
    option (it starts with ``-``), or that no argument can hold (a NUL)."""

    def __init__(self, placeholder: str, value: str):
        shown = clean_text(value)
        shown = shown if len(shown) <= 200 else shown[:199] + "…"
        why = (
            "holds a NUL character, which no command-line argument can"
            if "\x00" in value
            else "starts with '-', which an engine would read as an option"
        )
        super().__init__(
            f"The command line would get {shown!r} for {{{placeholder}}}, which "
            f"{why}; refused without a retry, the engine was not started."
        )


class _Arguments(string.Formatter):
    """Fills in one job's command line as ``str.format`` would, refusing every
    value it substitutes that starts with ``-`` or holds a NUL. Sources,
    ``file:`` paths once decoded (``file:%2Drf`` is ``-rf``) and params all come
    from manifests: whatever the server checked, the worker checks again what
    the engine would really get."""

    def __init__(self) -> None:
        super().__init__()
        self._placeholder = ""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        self._placeholder = field_name
        return super().get_field(field_name, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> str:
        text = super().format_field(value, format_spec)
        if text.startswith("-") or "\x00" in text:
            raise UnsafeArgument(self._placeholder, text)
        return text


def command_line(argv: list[str], values: dict[str, Any]) -> list[str]:
    """The engine's arguments: each of the template's, filled in. Raises
    MissingParam or UnsafeArgument, and then no engine may run."""
    arguments = _Arguments()
    return [arguments.vformat(arg, (), values) for arg in argv]


def source_path(source: str) -> str:
    """A ``file://`` URL as a local path; anything else unchanged."""
    parsed = urllib.parse.urlsplit(source)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return urllib.parse.unquote(parsed.path)
    return source


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def is_local(source: str) -> bool:
    """True for a ``file://`` URL or a plain path (a single letter before a colon
    is a Windows drive, not a scheme), as the server's intake reads them."""
    match = _SCHEME.match(source)
    return match is None or len(match.group(1)) == 1 or match.group(1).lower() == "file"


class SourceRoot:
    """``--source-root``: local sources must resolve to a path inside it."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)

    def resolve(self, source: str) -> str | None:
        """The real path of a local source inside the root (``..`` and symlinks
        resolved), the source itself when it is not local, or None when it is
        outside (a ``file://`` URL naming another host included)."""
        if not is_local(source):
            return source
        path = source_path(source)
        if "://" in path:  # file://otherhost/...: not a path on this machine
            return None
        real = os.path.realpath(path)
        if os.path.commonpath([self.root, real]) != self.root:
            return None
        return real

    def check(self, job: Job) -> Job | Failure:
        """The job with its checked path, or a failure that is not retried."""
        path = self.resolve(job.source)
        if path is None:
            return Failure(
                f"The source {job.source!r} is outside --source-root {self.root} "
                f"(after resolving '..' and symbolic links); refused without a "
                f"retry.",
                retryable=False,
            )
        return (
            dataclasses.replace(job, local_path=path) if is_local(job.source) else job
        )


PLACEHOLDERS = {
    "source": "the item's source, as in the manifest",
    "source_path": "the same, file:// URLs as local paths",
    "outdir": "an empty directory for output files",
    "params": "the item's params as JSON",
    "params[NAME]": "one param (a missing one fails the job)",
    "duration": "audio seconds from the manifest, or empty",
    "job_id": "the job id",
    "item_id": "the item id",
    "batch_id": "the batch id",
    "attempt": "the attempt number (1 for the first)",
}


def _placeholder_values(job: Job, outdir: str) -> dict[str, Any]:
    return {
        "source": job.source,
        "source_path": job.local_path or source_path(job.source),
        "outdir": outdir,
        "params": _Params(job.params),
        "duration": "" if job.duration is None else f"{job.duration:g}",
        "job_id": str(job.id),
        "item_id": "" if job.item_id is None else str(job.item_id),
        "batch_id": "" if job.batch_id is None else str(job.batch_id),
        "attempt": str(job.attempt),
    }


def check_template(template: str) -> list[str]:
    """Split ``template`` like a shell would (no shell runs it) and check every
    placeholder, so a typo fails at start-up instead of on every job."""
    try:
        argv = shlex.split(template)
    except ValueError as error:
        raise ValueError(f"cannot split the command: {error}") from None
    if not argv:
        raise ValueError("the command is empty")
    formatter = string.Formatter()
    for arg in argv:
        try:
            fields = list(formatter.parse(arg))
        except ValueError as error:
            raise ValueError(
                f"{arg!r}: {error} (write {{{{ and }}}} for braces)"
            ) from None
        for _, name, _, _ in fields:
            if name is None:
                continue
            root = name.split("[", 1)[0].split(".", 1)[0]
            if root not in PLACEHOLDERS:
                known = ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
                raise ValueError(f"unknown placeholder {{{name}}}; known: {known}")
            if name != root and not (root == "params" and name.startswith("params[")):
                raise ValueError(f"{{{name}}}: only {{params[NAME]}} takes an index")
    return argv


class CommandEngine(Engine):
    """Runs a command per job; see ``--command`` in ``--help``."""

    name = "command"

    def __init__(
        self,
        template: str,
        *,
        timeout: float | None,
        non_retryable: frozenset[int],
        workdir: str | None,
        registry: ProcessRegistry,
    ):
        self.argv = check_template(template)
        self.timeout = timeout
        self.non_retryable = non_retryable
        self.workdir = workdir
        self.registry = registry

    def run(self, job: Job, cancel: Cancellation) -> Outcome:
        outdir = tempfile.mkdtemp(prefix=f"recall-job{job.id}-", dir=self.workdir)
        try:
            return self._run(job, cancel, outdir)
        finally:
            shutil.rmtree(outdir, ignore_errors=True)

    def _run(self, job: Job, cancel: Cancellation, outdir: str) -> Outcome:
        values = _placeholder_values(job, outdir)
        try:
            argv = command_line(self.argv, values)
        except MissingParam as error:
            return Failure(
                f"The command template needs params[{error.args[0]!r}], which this "
                f"item does not have.",
                retryable=False,
            )
        except UnsafeArgument as error:
            return Failure(str(error), retryable=False)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._child_env(job, values),
                # Its own process group, so killing it kills everything it started.
                start_new_session=True,
                # And it dies with the worker, even if the worker is SIGKILLed.
                preexec_fn=die_with_parent(),
            )
        except OSError as error:
            return Failure(f"Could not start the engine {argv[0]!r}: {error}.")
        self.registry.add(proc)
        try:
            return self._wait(job, cancel, proc, outdir)
        finally:
            self.registry.remove(proc)

    def _wait(
        self, job: Job, cancel: Cancellation, proc: subprocess.Popen, outdir: str
    ) -> Outcome:
        stdout: list[bytes] = []
        stderr: deque[bytes] = deque()
        readers = [
            threading.Thread(
                target=_read_all, args=(proc.stdout, stdout, MAX_STDOUT_BYTES)
            ),
            threading.Thread(target=_read_tail, args=(proc.stderr, stderr)),
        ]
        for reader in readers:
            reader.daemon = True
            reader.start()
        cancel.on_cancel(lambda: kill_group(proc))
        timed_out = False
        try:
            proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            proc.wait()
        # Whatever the engine left running in its group goes with it.
        kill_group(proc)
        for reader in readers:
            reader.join(timeout=5)
        tail = b"".join(stderr).decode("utf-8", "replace").strip()
        if cancel.is_set():
            return Aborted(cancel.reason)
        if timed_out:
            return Failure(
                _with_tail(
                    f"The engine timed out after {self.timeout:g}s and was killed.",
                    tail,
                )
            )
        status = proc.returncode
        if status != 0:
            if status < 0:
                try:
                    name = signal.Signals(-status).name
                except ValueError:
                    name = f"signal {-status}"
                message = f"The engine was killed by {name}."
            else:
                message = f"The engine exited with status {status}."
            return Failure(
                _with_tail(message, tail), retryable=status not in self.non_retryable
            )
        output = b"".join(stdout)
        if len(output) > MAX_STDOUT_BYTES:
            return Failure(f"The engine printed more than {MAX_STDOUT_BYTES} bytes.")
        try:
            return Success(parse_output(output, outdir))
        except (ValueError, OSError) as error:
            return Failure(_with_tail(f"Unusable engine output: {error}.", tail))

    @staticmethod
    def _child_env(job: Job, values: dict[str, Any]) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(PRIVATE_ENV_PREFIXES)
        }
        env.pop("RECALL_URL", None)
        for name, value in values.items():
            env[f"RECALL_{name.upper()}"] = format(value)
        return env


PR_SET_PDEATHSIG = 1  # linux/prctl.h


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl(2), on Linux; loaded once, in the worker, never in a child."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux SIGKILL the child when the worker dies.

    Without it, a worker killed by SIGKILL (or the OOM killer) leaves its engine
    running on the GPU with nobody to report its result. Elsewhere, None.

    The death signal fires when the *thread* that started the child ends; each
    engine is started and waited for by its slot's thread, which outlives it.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        # Runs in the child between fork and exec: nothing here takes a lock.
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the worker died before the line above
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _read_all(pipe: Any, chunks: list[bytes], limit: int) -> None:
    """Collect a pipe up to ``limit`` (+1 byte, to notice overflow); drain the rest."""
    size = 0
    for chunk in iter(lambda: pipe.read1(65536), b""):
        if size <= limit:
            chunks.append(chunk)
            size += len(chunk)
    pipe.close()


def _read_tail(pipe: Any, chunks: deque[bytes]) -> None:
    """Keep the last STDERR_TAIL_BYTES of a pipe: the end says what went wrong."""
    size = 0
    for chunk in iter(lambda: pipe.read1(65536), b""):
        chunks.append(chunk)
        size += len(chunk)
        while size - len(chunks[0]) >= STDERR_TAIL_BYTES:
            size -= len(chunks.popleft())
    pipe.close()


def _with_tail(message: str, tail: str) -> str:
    if not tail:
        return message
    return message + "\n--- stderr (last lines) ---\n" + tail


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the engine's whole process group (it is the group's leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class ProcessRegistry:
    """Engine processes alive right now, so a hard exit can kill them first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)

    def remove(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            kill_group(proc)


SIM_SENTENCES = (
    "Thanks everyone for joining today.",
    "Let's start with a quick round of updates.",
    "The first results came back on Tuesday.",
    "We saw a clear improvement over last quarter.",
    "I think we should look at the numbers again.",
    "Can you say a bit more about that?",
    "That's a fair point, and it's worth checking.",
    "The field team interviewed forty households.",
    "Most people mentioned the cost of transport.",
    "We'll send the summary by the end of the week.",
    "Sorry, could you repeat the last part?",
    "The recording quality was good in most places.",
    "Let's move on to the next item on the agenda.",
    "She said the new schedule works much better.",
    "We still need a decision on the budget.",
    "I'll follow up with the regional office.",
    "Does anyone have questions before we wrap up?",
    "Thank you, that's all for today.",
)


def simulated_transcript(
    item_id: int | None, duration: float, quirk: object = None
) -> dict:
    """A plausible transcript with timed segments covering ``duration`` seconds.

    Seeded by the item, so a retried item gets the same words. The item's
    ``params.simulate`` may ask for a transcript that comes out wrong (demos of
    the quality flags): ``silence`` (no words) or ``mumble`` (one sentence,
    however long the audio).
    """
    rng = random.Random(item_id)
    segments, t = [], 0.0
    if quirk == "silence":
        duration = 0.0
    elif quirk == "mumble":
        duration = min(duration, 3.0)
    while t < duration:
        length = min(rng.uniform(2.5, 7.0), duration - t)
        text = rng.choice(SIM_SENTENCES)
        segments.append(
            {"start": round(t, 3), "end": round(t + length, 3), "text": text}
        )
        t += length + rng.uniform(0.2, 1.2)
    return {
        "text": " ".join(s["text"] for s in segments),
        "segments": segments,
        "language": "en",
        "engine": "simulate",
    }


class SimulateEngine(Engine):
    """A fake engine for demos and tests: see ``--simulate`` in ``--help``."""

    name = "simulate"

    def __init__(self, *, factor: float, fail_rate: float, default_duration: float):
        self.factor = factor
        self.fail_rate = fail_rate
        self.default_duration = default_duration
        self.rng = random.Random()

    def run(self, job: Job, cancel: Cancellation) -> Outcome:
        duration = job.duration if job.duration is not None else self.default_duration
        work = max(0.0, duration * self.factor)
        if self.rng.random() < self.fail_rate:
            at = work * self.rng.uniform(0.1, 0.9)
            if cancel.wait(at):
                return Aborted(cancel.reason)
            return Failure(
                f"Simulated failure: the decoder crashed {at:.1f}s into the job "
                f"(--simulate-fail-rate {self.fail_rate:g})."
            )
        if cancel.wait(work):
            return Aborted(cancel.reason)
        quirk = job.params.get("simulate")
        return Success(simulated_transcript(job.item_id, duration, quirk))


# --- The worker -------------------------------------------------------------------


class Shutdown:
    """Process-wide stop state: the first signal starts a graceful stop."""

    def __init__(self, grace: float):
        self.grace = grace
        self._requested_at: float | None = None
        self.exit_code = EXIT_STOPPED
        self._lock = threading.Lock()
        self._jobs: set[Cancellation] = set()

    @property
    def requested(self) -> bool:
        return self._requested_at is not None

    def request(self, reason: str, exit_code: int = EXIT_STOPPED) -> bool:
        """Start stopping; False if already stopping. Cancels every running job."""
        with self._lock:
            if self._requested_at is not None:
                return False
            self._requested_at = time.monotonic()
            self.exit_code = exit_code
            jobs = list(self._jobs)
        log.info("stopping (%s): engines stopped, leases being released", reason)
        for cancel in jobs:
            cancel.cancel("shutdown")
        return True

    def grace_over(self) -> bool:
        """True once stopping has taken longer than the grace period."""
        at = self._requested_at
        return at is not None and time.monotonic() - at > self.grace

    def track(self, cancel: Cancellation) -> None:
        with self._lock:
            self._jobs.add(cancel)
            stopping = self._requested_at is not None
        if stopping:
            cancel.cancel("shutdown")

    def untrack(self, cancel: Cancellation) -> None:
        with self._lock:
            self._jobs.discard(cancel)


@dataclass(frozen=True)
class Settings:
    """What the slots need of the options (see ``build_parser``)."""

    poll_min: float = 1.0
    poll_max: float = 30.0
    http_timeout: float = 30.0
    wait_seconds: float = 25.0
    source_root: SourceRoot | None = None
    labels: dict[str, str] = dataclasses.field(default_factory=dict)


class ServerForms:
    """Which forms of the calls for many leases the server takes. A server
    older than them answers 400 (or 404: no such path) to a claim with
    ``max_jobs``, to the batched heartbeat or to the batched completion; from
    then on this worker uses the single forms with it (one job per claim, one
    heartbeat per lease, one completion per job) until it restarts."""

    def __init__(self) -> None:
        self.many_jobs_per_claim = True
        self.batched_heartbeats = True
        self.batched_completions = True

    def single_claims(self, error: ApiError) -> None:
        if self.many_jobs_per_claim:
            self.many_jobs_per_claim = False
            log.warning(
                "the server refused a claim of several jobs (%s): claiming one "
                "job per call from now on",
                error,
            )

    def single_heartbeats(self, error: ApiError) -> None:
        if self.batched_heartbeats:
            self.batched_heartbeats = False
            log.warning(
                "the server refused a batched heartbeat (%s): heartbeating each "
                "lease on its own from now on",
                error,
            )

    def single_completions(self, error: ApiError) -> None:
        if self.batched_completions:
            self.batched_completions = False
            log.warning(
                "the server refused a batched completion (%s): completing each "
                "job on its own from now on",
                error,
            )


def many_forms_refused(error: ApiError) -> bool:
    """An answer that says the server does not know a call's many-lease form."""
    return isinstance(error, Rejected) and error.status in (400, 404)


class Lease:
    """One job's live lease while a slot works on it: what its heartbeats
    found (lost, or the worker refused), and how to stop its engine."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.cancel = Cancellation()
        self.done = threading.Event()  # the slot finished with the job
        self.lost: str | None = None
        self.refused: Refused | None = None
        self.thread: Heartbeat | None = None  # its own heartbeat, if single
        self.accepted_at = time.monotonic()  # the claim, then each renewal
        self._warned = False

    def renewed(self) -> None:
        """A heartbeat of this lease was accepted."""
        self.accepted_at = time.monotonic()
        self._warned = False

    def warn_if_silent(self) -> None:
        """Warn once when no heartbeat was accepted for a whole lease: the
        server may have reclaimed it (the batched form's counterpart of the
        single ``Heartbeat``'s warning)."""
        silent = time.monotonic() - self.accepted_at
        if self._warned or silent <= self.job.lease_seconds or self.done.is_set():
            return
        self._warned = True
        log.warning(
            "%s no heartbeat accepted for %.0fs (lease %gs): the lease "
            "may be reclaimed; working on until the server says so",
            self.job.tag,
            silent,
            self.job.lease_seconds,
        )

    def lose(self, why: str) -> None:
        """The server says the lease is not ours: stop the engine."""
        if self.done.is_set() or self.lost is not None:
            return  # the job ended meanwhile: nothing to abandon
        self.lost = why
        log.warning("%s lease lost on heartbeat: stopping the engine", self.job.tag)
        self.cancel.cancel("lease lost")

    def refuse(self, error: Refused) -> None:
        self.refused = error
        self.cancel.cancel("refused")


class Heartbeats(threading.Thread):
    """Keeps every lease of this worker alive: one batched heartbeat per
    interval for all of them (``POST /heartbeat``), each lease answered alone;
    against a server that does not take it, a thread per lease heartbeating
    it on its own (``Heartbeat``).

    A lease the server says is lost (or whose job is gone) has its engine
    killed at once and its job abandoned. Network trouble is retried within
    the interval; the leases stay live on the server until they are reclaimed,
    so a late heartbeat may still save them.
    """

    def __init__(self, api: Api, forms: ServerForms, shutdown: Shutdown):
        super().__init__(name="heartbeats", daemon=True)
        self.api, self.forms, self.shutdown = api, forms, shutdown
        self._lock = threading.Condition()
        self._leases: dict[int, Lease] = {}
        self._due = math.inf  # when the next batched heartbeat is due (monotonic)
        self._stopped = False

    def add(self, lease: Lease) -> None:
        with self._lock:
            if self.forms.batched_heartbeats:
                self._leases[lease.job.id] = lease
                self._due = min(
                    self._due, time.monotonic() + lease.job.heartbeat_interval
                )
                self._lock.notify_all()
                return
        self._alone(lease)

    def remove(self, lease: Lease) -> None:
        """The slot is done with the job: no more heartbeats for its lease."""
        lease.done.set()
        with self._lock:
            self._leases.pop(lease.job.id, None)
            if not self._leases:
                self._due = math.inf  # the next lease starts its own interval

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    def _alone(self, lease: Lease) -> None:
        lease.thread = Heartbeat(lease, self.api)
        lease.thread.start()

    def run(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and (
                    not self._leases or time.monotonic() < self._due
                ):
                    self._lock.wait(
                        None if not self._leases else self._due - time.monotonic()
                    )
                if self._stopped:
                    return
                leases = sorted(self._leases.values(), key=lambda lease: lease.job.id)
                interval = min(lease.job.heartbeat_interval for lease in leases)
                self._due = time.monotonic() + interval
            for chunk in range(0, len(leases), MAX_HEARTBEAT_LEASES):
                self._beat(leases[chunk : chunk + MAX_HEARTBEAT_LEASES], interval)

    def _beat(self, leases: list[Lease], interval: float) -> None:
        """One batched heartbeat of ``leases``, retried within the interval."""
        for lease in leases:
            lease.warn_if_silent()
        body = {
            "leases": [
                {"job_id": lease.job.id, "lease_token": lease.job.lease_token}
                for lease in leases
            ]
        }

        def over() -> bool:
            for lease in leases:
                lease.warn_if_silent()  # while the server cannot be reached
            return self._stopped or all(lease.done.is_set() for lease in leases)

        try:
            _, payload = self.api.call(
                "/heartbeat",
                body,
                what=f"heartbeat of {len(leases)} leases",
                give_up=over,
                cap=interval,
                timeout=max(2.0, min(self.api.timeout, interval)),
            )
        except GaveUp:
            return
        except Refused as error:
            for lease in leases:
                lease.refuse(error)
            return
        except ApiError as error:
            if not many_forms_refused(error):
                log.error("batched heartbeat refused: %s", error)
                return
            # Every lease from now on heartbeats alone, these and any added
            # meanwhile (under the lock: none is left out, none beaten twice).
            with self._lock:
                self.forms.single_heartbeats(error)
                moved = list(self._leases.values())
                self._leases.clear()
            for lease in moved:
                if not lease.done.is_set():
                    self._alone(lease)
            return
        answers = (payload or {}).get("leases")
        if not isinstance(answers, list):
            log.error("batched heartbeat: malformed response: %s", payload)
            return
        by_job = {lease.job.id: lease for lease in leases}
        for answer in answers:
            lease = (
                by_job.get(answer.get("job_id")) if isinstance(answer, dict) else None
            )
            if lease is None:
                continue
            if "lease_expires_at" in answer:
                lease.renewed()
                log.debug("%s heartbeat ok", lease.job.tag)
            else:
                error = answer.get("error")
                lease.lose(
                    "404 not_found" if error == "not_found" else "409 lease_lost"
                )


class Heartbeat(threading.Thread):
    """Extends one lease every ``heartbeat_interval`` until the job is done: the
    single form, against a server that does not take batched heartbeats.

    A 409 means the server took the lease back: the engine is killed at once and
    the job abandoned. Network trouble is retried; the lease stays live on the
    server until it is reclaimed, so a late heartbeat may still save it.
    """

    def __init__(self, lease: Lease, api: Api):
        super().__init__(name=f"job-{lease.job.id}-hb", daemon=True)
        self.lease, self.api = lease, api

    def run(self) -> None:
        lease, job = self.lease, self.lease.job
        interval = job.heartbeat_interval
        last_ok = time.monotonic()
        warned = False
        while not lease.done.wait(max(0.0, last_ok + interval - time.monotonic())):
            try:
                self.api.call(
                    f"/jobs/{job.id}/heartbeat",
                    {"lease_token": job.lease_token},
                    what=f"{job.tag} heartbeat",
                    give_up=lease.done.is_set,
                    cap=interval,
                    timeout=max(2.0, min(self.api.timeout, interval)),
                )
            except GaveUp:
                return
            except (LeaseLost, Rejected) as error:
                lease.lose(f"{error.status} {error.code}")
                return
            except Refused as error:
                lease.refuse(error)
                return
            else:
                last_ok = time.monotonic()
                warned = False
                log.debug("%s heartbeat ok", job.tag)
                continue
            finally:
                silent = time.monotonic() - last_ok
                if (
                    not warned
                    and silent > job.lease_seconds
                    and not lease.done.is_set()
                ):
                    warned = True
                    log.warning(
                        "%s no heartbeat accepted for %.0fs (lease %gs): the lease "
                        "may be reclaimed; working on until the server says so",
                        job.tag,
                        silent,
                        job.lease_seconds,
                    )


class Claimer(threading.Thread):
    """Claims work for the slots: whenever some are free, one claim asks for
    as many jobs as there are free slots (``max_jobs``), with this worker's
    labels, and hands each job to a slot. Against a server that does not take
    ``max_jobs``, one job per claim.

    Each claim asks the server to hold it up to --wait-seconds while the
    queue is empty (a long-poll); an empty answer after such a wait is
    followed by the next claim at once. An empty queue answered sooner (a
    server that does not wait) is polled with jittered backoff up to
    --poll-max, and so is a claim the server refused for a reason no retry
    inside ``Api.call`` could fix; the pause resets once work arrives.
    """

    def __init__(
        self,
        slots: int,
        *,
        api: Api,
        settings: Settings,
        shutdown: Shutdown,
        forms: ServerForms,
    ):
        super().__init__(name="claims", daemon=True)
        self.api, self.settings, self.shutdown = api, settings, shutdown
        self.forms = forms
        self.slots = slots
        self._lock = threading.Condition()
        self._ready: deque[Job] = deque()  # claimed, waiting for a slot
        self._busy = 0  # slots working on a job
        self.refused_by: Refused | None = None

    # The slots' side.

    def take(self) -> Job | None:
        """A claimed job for a slot (which is busy from now on), or None once
        stopping."""
        with self._lock:
            while not self._ready and not self.shutdown.requested:
                self._lock.wait(0.2)
            if self.shutdown.requested:
                return None
            self._busy += 1
            return self._ready.popleft()

    def finished(self) -> None:
        """A slot is done with its job: free again."""
        with self._lock:
            self._busy -= 1
            self._lock.notify_all()

    def leftovers(self) -> list[Job]:
        """Jobs claimed that no slot took (stopping): to be released."""
        with self._lock:
            jobs, self._ready = list(self._ready), deque()
        return jobs

    def _free(self) -> int:
        return self.slots - self._busy - len(self._ready)

    # Claiming.

    def run(self) -> None:
        try:
            while not self.shutdown.requested:
                with self._lock:
                    while self._free() <= 0 and not self.shutdown.requested:
                        self._lock.wait(0.2)
                    free = self._free()
                if self.shutdown.requested:
                    return
                jobs = self.claim(min(free, MAX_CLAIM_JOBS))
                with self._lock:
                    self._ready.extend(jobs)
                    self._lock.notify_all()
        except Refused as error:
            self.refused_by = error
            refused(error, self.shutdown)
        except Exception:
            log.exception("unexpected error; stopping the worker")
            self.shutdown.request("unexpected error", exit_code=1)

    def claim(self, free: int) -> list[Job]:
        """Up to ``free`` jobs, at least one; none once stopping."""
        wait = self.settings.wait_seconds
        empty = 0
        pauses = 0
        while not self.shutdown.requested:
            started = time.monotonic()
            many = self.forms.many_jobs_per_claim
            try:
                status, payload = self._claim_call(wait, free if many else None)
            except GaveUp:
                return []
            except (LeaseLost, Rejected) as error:
                if many and many_forms_refused(error):
                    self.forms.single_claims(error)
                    continue  # at once, in the single form
                if error.status == 404:  # no API here: the URL is wrong
                    raise Refused(error.status, error.code, error.detail) from None
                log.error("claim refused: %s", error)
            else:
                if status == 204 or payload is None:
                    empty += 1
                    if empty == 1:
                        log.info(
                            "queue empty; waiting up to %gs per claim, polling "
                            "with backoff up to %gs if the server answers sooner",
                            wait,
                            self.settings.poll_max,
                        )
                    if wait and time.monotonic() - started >= wait / 2:
                        pauses = 0  # the server held the claim: ask again now
                        continue
                else:
                    try:
                        jobs = claimed_jobs(payload)
                    except (KeyError, TypeError, ValueError) as error:
                        log.error("claim: malformed response (%r): %s", error, payload)
                    else:
                        if empty:
                            log.info("work available after %d empty polls", empty)
                        return [job for job in jobs if self.adopt(job)]
            pauses += 1
            delay = backoff_delay(
                pauses, base=self.settings.poll_min, cap=self.settings.poll_max
            )
            pause(delay, lambda: self.shutdown.requested)
        return []

    def _claim_call(self, wait: float, max_jobs: int | None) -> tuple[int, dict | None]:
        """One claim, with its retries. A long-poll runs on a helper thread so
        that a signal stops an idle worker at once: the claimer gives up, the
        process exits, its connection closes, and the server drops the waiting
        claim without leasing anything."""
        body: dict[str, Any] = {}
        if wait:
            body["wait_seconds"] = wait
        if max_jobs is not None:
            body["max_jobs"] = max_jobs
        if self.settings.labels:
            body["labels"] = self.settings.labels

        def stopping() -> bool:
            return self.shutdown.requested

        if not wait:
            return self.api.call("/claim", body, what="claim", give_up=stopping)
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(
                    self.api.call(
                        "/claim",
                        body,
                        what="claim",
                        give_up=stopping,
                        timeout=wait + self.settings.http_timeout,
                    )
                )
            except BaseException as error:  # handed to the claimer below
                outcome.append(error)

        helper = threading.Thread(target=run, name=f"{self.name}-call", daemon=True)
        helper.start()
        while helper.is_alive():
            helper.join(0.2)
            if self.shutdown.requested and helper.is_alive():
                raise GaveUp("stopping while the server holds a claim")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def adopt(self, job: Job) -> bool:
        REDACTOR.add(job.lease_token)  # never in a log line, from here on
        duration = "unknown" if job.duration is None else f"{job.duration:g}s"
        log.info(
            "%s claimed: batch=%s item=%s source=%s duration=%s lease=%gs",
            job.tag,
            job.batch_id,
            job.item_id,
            job.source,
            duration,
            job.lease_seconds,
        )
        if self.shutdown.requested:  # a signal arrived while the claim was in flight
            release(self.api, job, self.shutdown)
            REDACTOR.discard(job.lease_token)
            return False
        return True


def claimed_jobs(payload: dict) -> list[Job]:
    """The jobs of a claim's answer: ``{"jobs": [...]}`` to a claim of several,
    or ``{"job": {...}}`` (a server that ignored ``max_jobs``)."""
    if "jobs" in payload:
        jobs = payload["jobs"]
        if not isinstance(jobs, list) or not jobs:
            raise ValueError("'jobs' is not a list of jobs")
        return [Job.from_claim({"job": job}) for job in jobs]
    return [Job.from_claim(payload)]


def refused(error: Refused, shutdown: Shutdown) -> None:
    hint = {
        401: "check RECALL_TOKEN (create one with `manage.py create_worker`)",
        403: "an operator disabled this worker",
    }.get(error.status, "check RECALL_URL")
    log.error("the server refused this worker: %s (%s)", error, hint)
    shutdown.request("refused by the server", exit_code=EXIT_REFUSED)


def release(api: Api, job: Job, shutdown: Shutdown) -> None:
    """Give a job back at once (stopping): the attempt is not counted."""
    body = {"lease_token": job.lease_token}
    try:
        api.call(
            f"/jobs/{job.id}/release",
            body,
            what=f"{job.tag} release",
            give_up=shutdown.grace_over,
        )
    except (LeaseLost, Rejected) as error:
        log.warning("%s release not needed: %s", job.tag, error)
        return
    except Refused as error:
        log.error("%s release refused: %s", job.tag, error)
        return
    except GaveUp as error:
        log.error(
            "%s release abandoned (%s): the lease expires in at most %gs",
            job.tag,
            error,
            job.lease_seconds,
        )
        return
    log.info("%s released: queued again at once", job.tag)


class _Report:
    """One slot's completion, waiting to be reported."""

    def __init__(self, job: Job, result: dict) -> None:
        self.job, self.result = job, result
        self.done = False
        self.error: BaseException | None = None


class Completions:
    """Reports the slots' results. A result is sent at once when no report is
    on its way; those that finish while one is (several leases ending close
    together) go in the next call together, one batched completion
    (``POST /complete``) for up to MAX_COMPLETIONS of them, each answered
    alone. A slot waits for its own answer, and sees exactly what the single
    completion would have told it (``report`` raises the same errors): a
    lost lease or a gone job is one entry's answer and never stops the
    others. Against a server that answers 400 or 404 to the batched form
    (older than it) every result is reported alone from then on; a batch
    too large for the server's body limit (413) is reported result by
    result."""

    def __init__(
        self, api: Api, forms: ServerForms, give_up: Callable[[], bool]
    ) -> None:
        self.api, self.forms, self.give_up = api, forms, give_up
        self._lock = threading.Condition()
        self._waiting: list[_Report] = []
        self._sending = False

    def report(self, job: Job, result: dict) -> None:
        """Report ``job`` completed with ``result``; raise what the single
        completion would (LeaseLost, Rejected, Refused, GaveUp)."""
        mine = _Report(job, result)
        with self._lock:
            self._waiting.append(mine)
        while True:
            with self._lock:
                while self._sending and not mine.done:
                    self._lock.wait()
                if mine.done:
                    break
                self._sending = True
                batch = self._waiting[:MAX_COMPLETIONS]
                del self._waiting[:MAX_COMPLETIONS]
            try:
                self._send(batch)
            except BaseException as error:  # a bug: no slot may take it for a success
                for report in batch:
                    if report is not mine and report.error is None:
                        report.error = error
                raise
            finally:
                with self._lock:
                    for report in batch:
                        report.done = True
                    self._sending = False
                    self._lock.notify_all()
        if mine.error is not None:
            raise mine.error

    def _send(self, batch: list[_Report]) -> None:
        if len(batch) > 1 and self.forms.batched_completions:
            try:
                self._together(batch)
                return
            except ApiError as error:
                if many_forms_refused(error):
                    self.forms.single_completions(error)
                elif error.status != 413:
                    for report in batch:
                        report.error = error
                    return
                # Refused by the older server, or too large together: alone.
            except (GaveUp, Refused) as error:
                for report in batch:
                    report.error = error
                return
        for report in batch:
            try:
                self._alone(report)
            except (ApiError, GaveUp) as error:
                report.error = error

    def _alone(self, report: _Report) -> None:
        job = report.job
        self.api.call(
            f"/jobs/{job.id}/complete",
            {"lease_token": job.lease_token, "result": report.result},
            what=f"{job.tag} complete",
            give_up=self.give_up,
        )

    def _together(self, batch: list[_Report]) -> None:
        body = {
            "results": [
                {
                    "job_id": report.job.id,
                    "lease_token": report.job.lease_token,
                    "result": report.result,
                }
                for report in batch
            ]
        }
        _, payload = self.api.call(
            "/complete",
            body,
            what=f"completion of {len(batch)} jobs",
            give_up=self.give_up,
        )
        answers = (payload or {}).get("results")
        by_job = {
            answer.get("job_id"): answer
            for answer in (answers if isinstance(answers, list) else [])
            if isinstance(answer, dict)
        }
        for report in batch:
            answer = by_job.get(report.job.id, {})
            if answer.get("status") == "completed":
                continue
            error = answer.get("error")
            if error == "lease_lost":
                report.error = LeaseLost(409, "lease_lost", "not this worker's lease")
            elif error == "not_found":
                report.error = Rejected(404, "not_found", "no such job")
            else:  # not answered: report it alone, as the single form would
                try:
                    self._alone(report)
                except (ApiError, GaveUp) as failed:
                    report.error = failed


class Slot(threading.Thread):
    """One job at a time, forever: take a claimed job, run it while its lease
    is heartbeated, complete or fail it.

    ``--concurrency N`` runs N slots; each job is under its own lease.
    """

    def __init__(
        self,
        number: int,
        *,
        api: Api,
        engine: Engine,
        settings: Settings,
        shutdown: Shutdown,
        claimer: Claimer,
        heartbeats: Heartbeats,
        completions: Completions | None = None,
    ):
        super().__init__(name=f"slot-{number}")
        self.api, self.engine, self.settings = api, engine, settings
        self.shutdown = shutdown
        self.claimer, self.heartbeats = claimer, heartbeats
        self.completions = completions or Completions(
            api, ServerForms(), shutdown.grace_over
        )

    def run(self) -> None:
        try:
            while not self.shutdown.requested:
                job = self.claimer.take()
                if job is None:
                    break
                try:
                    self.work(job)
                finally:
                    self.claimer.finished()
        except Refused as error:
            refused(error, self.shutdown)
        except Exception:
            log.exception("unexpected error; stopping the worker")
            self.shutdown.request("unexpected error", exit_code=1)

    # Working.

    def work(self, job: Job) -> None:
        lease = Lease(job)
        cancel = lease.cancel
        self.shutdown.track(cancel)
        self.heartbeats.add(lease)
        started = time.monotonic()
        try:
            checked = self._checked(job)
            if isinstance(checked, Failure):
                outcome: Outcome = checked
            else:
                outcome = self.engine.run(checked, cancel)
        except Exception as error:  # an engine bug must not kill the worker
            log.exception("%s engine error", job.tag)
            outcome = Failure(f"The worker's engine raised {error!r}.")
        finally:
            self.heartbeats.remove(lease)
            self.shutdown.untrack(cancel)
        elapsed = time.monotonic() - started
        try:
            if lease.lost is not None:
                log.warning(
                    "%s abandoned after %.1fs: lease lost (%s)",
                    job.tag,
                    elapsed,
                    lease.lost,
                )
            elif isinstance(outcome, Success):
                self.complete(job, outcome.result, elapsed)
            elif isinstance(outcome, Failure):
                self.fail(job, outcome, elapsed)
            elif outcome.reason == "shutdown":
                self.release(job)
            else:
                log.warning("%s abandoned: %s", job.tag, outcome.reason)
        finally:
            if lease.thread is not None:
                lease.thread.join(timeout=self.settings.http_timeout + 1)
            REDACTOR.discard(job.lease_token)
        if lease.refused is not None:
            raise lease.refused

    def _checked(self, job: Job) -> Job | Failure:
        root = self.settings.source_root
        return job if root is None else root.check(job)

    def _finishing(self) -> bool:
        """Give up a completion or failure report only once the grace is over."""
        return self.shutdown.grace_over()

    def complete(self, job: Job, result: dict, elapsed: float) -> None:
        try:
            # Alone, or with other slots' results that end close to it.
            self.completions.report(job, result)
        except LeaseLost as error:
            log.warning("%s result discarded: lease lost (%s)", job.tag, error.detail)
            return
        except Rejected as error:
            if error.status == 404:
                log.warning("%s result discarded: the job is gone", job.tag)
                return
            # 413 (too large) or 400: this result will never be accepted.
            log.error("%s result refused: %s", job.tag, error)
            self.fail(
                job,
                Failure(
                    f"The server refused the result ({error.status} {error.code}: "
                    f"{error.detail}).",
                    retryable=False,
                ),
                elapsed,
            )
            return
        except GaveUp as error:
            log.error(
                "%s complete abandoned while stopping (%s); the lease will expire "
                "and the job will run again",
                job.tag,
                error,
            )
            return
        log.info(
            "%s completed in %.1fs: %d chars, %d segments",
            job.tag,
            elapsed,
            len(result.get("text", "")),
            len(result.get("segments") or []),
        )

    def fail(self, job: Job, failure: Failure, elapsed: float) -> None:
        body = {
            "lease_token": job.lease_token,
            "error": clean_text(failure.error, MAX_ERROR_CHARS),
            "retryable": failure.retryable,
        }
        first_line = failure.error.strip().splitlines()[0] if failure.error else ""
        try:
            _, payload = self.api.call(
                f"/jobs/{job.id}/fail",
                body,
                what=f"{job.tag} fail",
                give_up=self._finishing,
            )
        except (LeaseLost, Rejected) as error:
            log.warning("%s failure not recorded: %s", job.tag, error)
            return
        except GaveUp as error:
            log.error("%s fail abandoned while stopping (%s)", job.tag, error)
            return
        log.warning(
            "%s failed after %.1fs (%s, job now %s): %s",
            job.tag,
            elapsed,
            "retryable" if failure.retryable else "not retryable",
            (payload or {}).get("status", "?"),
            first_line,
        )

    def release(self, job: Job) -> None:
        release(self.api, job, self.shutdown)


# --- Command line -----------------------------------------------------------------

DESCRIPTION = """\
Recall reference worker: claims transcription jobs from Recall, runs an engine
on each, heartbeats while it works, and completes or fails the job; forever,
until stopped. One file, Python 3.11+, standard library only.

Every option can also be set in the environment (shown as [env NAME]); the
command line wins. Prefer RECALL_TOKEN or --token-file to --token, which other
users of the machine can see in the process list.
"""

EPILOG = """\
engines:
  --simulate           a built-in fake engine (demos, tests): takes
                       duration x --simulate-factor seconds and returns a
                       plausible transcript with segments.
  --command TEMPLATE   runs TEMPLATE per job. It is split like a shell command
                       line (quotes work) but no shell runs it, so a source with
                       spaces or quotes stays one argument. Placeholders:
{placeholders}
                       Write {{{{ and }}}} for literal braces. The engine also gets
                       them as environment variables (RECALL_SOURCE,
                       RECALL_OUTDIR, RECALL_PARAMS, ...), never the worker's
                       token. It runs in a process group of its own, which is
                       killed when the lease is lost, on shutdown and on timeout;
                       on Linux the engine is also killed if the worker dies
                       (even by SIGKILL).

  The result is read, in this order, from: a *.json file the engine wrote in
  {{outdir}} (result.json first); JSON printed on stdout (all of it, or its last
  line); plain text printed on stdout; a *.txt file in {{outdir}}. JSON has a
  "text" string and optionally "segments" ([{{"start", "end", "text"}}], seconds)
  and "language"; other fields are kept. An engine that exits 0 but produces no
  output fails the job.

engine exit status:
  0                    success: the output is the result.
  65, 66 (default)     the input is bad (EX_DATAERR) or missing (EX_NOINPUT):
                       the job fails for good, without a retry. Change the set
                       with --non-retryable-exit-codes.
  anything else        the job fails and is retried (the server applies backoff
                       and the attempt limit), as do a timeout and a kill by a
                       signal. The error sent is the last lines of stderr.

worker exit status:
  0    stopped by SIGTERM/SIGINT: engines killed, leases released
  2    bad command line
  3    the server refused this worker (401 bad token, 403 disabled, wrong URL):
       restarting will not help (systemd: RestartPreventExitStatus=3)
  128+N  a second signal N arrived while stopping: exited at once

examples:
  export RECALL_URL=https://recall.example.com RECALL_TOKEN=...
  python3 recall_worker.py --simulate --concurrency 4
  python3 recall_worker.py --command \\
      'python3 examples/pocketsphinx_engine.py {{source_path}}'
  python3 recall_worker.py --timeout 3600 --command 'whisper {{source_path}}
      --model small --output_format json --output_dir {{outdir}}'
"""


def _env(name: str, default: Any = None) -> Any:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text!r}")
    return value


def _wait_seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be from 0 to 60, not {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text!r}")
    return value


def _exit_codes(text: str) -> frozenset[int]:
    if text.strip().lower() == "none":
        return frozenset()
    try:
        codes = frozenset(int(c) for c in text.replace(" ", "").split(",") if c)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated numbers, not {text!r}"
        ) from None
    if any(not 1 <= c <= 255 for c in codes):
        raise argparse.ArgumentTypeError("exit codes are between 1 and 255")
    return codes


def build_parser() -> argparse.ArgumentParser:
    placeholders = "\n".join(
        f"    {{{name}}}".ljust(23) + doc for name, doc in PLACEHOLDERS.items()
    )
    parser = argparse.ArgumentParser(
        prog="recall_worker.py",
        description=DESCRIPTION,
        epilog=EPILOG.format(placeholders=placeholders),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--url",
        default=_env("RECALL_URL"),
        help="Recall's base URL, e.g. https://recall.example.com [env RECALL_URL]",
    )
    add(
        "--token",
        default=_env("RECALL_TOKEN"),
        help="this worker's API token (from `manage.py create_worker`) "
        "[env RECALL_TOKEN]",
    )
    add(
        "--token-file",
        default=_env("RECALL_TOKEN_FILE"),
        metavar="PATH",
        help="read the token from this file instead [env RECALL_TOKEN_FILE]",
    )
    engine = parser.add_mutually_exclusive_group()
    engine.add_argument(
        "--command",
        default=_env("RECALL_WORKER_COMMAND"),
        metavar="TEMPLATE",
        help="run this command per job (see 'engines' below) "
        "[env RECALL_WORKER_COMMAND]",
    )
    engine.add_argument(
        "--simulate",
        action="store_true",
        default=_env("RECALL_WORKER_SIMULATE", "") not in ("", "0", "false", "off"),
        help="use the built-in fake engine [env RECALL_WORKER_SIMULATE=1]",
    )
    add(
        "--concurrency",
        type=_positive_int,
        default=_env("RECALL_WORKER_CONCURRENCY", "1"),
        metavar="N",
        help="run N jobs at once, each under its own lease (default 1) "
        "[env RECALL_WORKER_CONCURRENCY]",
    )
    add(
        "--label",
        action="append",
        dest="label",
        metavar="KEY=VALUE",
        help="a label this worker offers, sent with each claim: only batches "
        "whose requirements it meets give it jobs (repeat for more; at most "
        f"{MAX_LABELS}) [env RECALL_WORKER_LABELS=gpu=a100,model=large-v3]",
    )
    add(
        "--timeout",
        type=_non_negative_float,
        default=_env("RECALL_WORKER_TIMEOUT", "0"),
        metavar="SECONDS",
        help="kill a --command engine after this long and fail the job "
        "(retryable); 0 = no limit (default) [env RECALL_WORKER_TIMEOUT]",
    )
    add(
        "--non-retryable-exit-codes",
        type=_exit_codes,
        default=_env(
            "RECALL_WORKER_NON_RETRYABLE_EXIT_CODES", DEFAULT_NON_RETRYABLE_EXIT_CODES
        ),
        metavar="CODES",
        help="engine exit statuses that fail the job for good, comma-separated "
        f"(default {DEFAULT_NON_RETRYABLE_EXIT_CODES}; none: retry them all) "
        "[env RECALL_WORKER_NON_RETRYABLE_EXIT_CODES]",
    )
    add(
        "--workdir",
        default=_env("RECALL_WORKER_WORKDIR"),
        metavar="DIR",
        help="where each job's {outdir} is created (default: the system's "
        "temporary directory) [env RECALL_WORKER_WORKDIR]",
    )
    add(
        "--source-root",
        default=_env("RECALL_WORKER_SOURCE_ROOT"),
        metavar="DIR",
        help="only read local sources (file:// URLs and plain paths) inside DIR, "
        "after resolving '..' and symbolic links; a job whose source is outside "
        "fails without a retry. Other schemes (s3://, https://...) are passed on "
        "[env RECALL_WORKER_SOURCE_ROOT]",
    )
    add(
        "--simulate-factor",
        type=_non_negative_float,
        default=_env("RECALL_WORKER_SIMULATE_FACTOR", "0.05"),
        metavar="X",
        help="--simulate works X seconds per second of audio (default 0.05) "
        "[env RECALL_WORKER_SIMULATE_FACTOR]",
    )
    add(
        "--simulate-fail-rate",
        type=_fraction,
        default=_env("RECALL_WORKER_SIMULATE_FAIL_RATE", "0"),
        metavar="P",
        help="fraction of --simulate jobs that fail, retryably (default 0) "
        "[env RECALL_WORKER_SIMULATE_FAIL_RATE]",
    )
    add(
        "--simulate-default-duration",
        type=_non_negative_float,
        default=_env("RECALL_WORKER_SIMULATE_DEFAULT_DURATION", "60"),
        metavar="SECONDS",
        help="audio length --simulate assumes when the manifest gave none "
        "(default 60) [env RECALL_WORKER_SIMULATE_DEFAULT_DURATION]",
    )
    add(
        "--poll-min",
        type=_positive_float,
        default=_env("RECALL_WORKER_POLL_MIN", "1"),
        metavar="SECONDS",
        help="first pause after an empty queue; doubles per empty poll "
        "(default 1) [env RECALL_WORKER_POLL_MIN]",
    )
    add(
        "--poll-max",
        type=_positive_float,
        default=_env("RECALL_WORKER_POLL_MAX", "30"),
        metavar="SECONDS",
        help="longest pause between polls of an empty queue (default 30) "
        "[env RECALL_WORKER_POLL_MAX]",
    )
    add(
        "--wait-seconds",
        type=_wait_seconds,
        default=_env("RECALL_WORKER_WAIT_SECONDS", "25"),
        metavar="SECONDS",
        help="how long the server may hold a claim while the queue is empty "
        "(0 to 60, default 25; 0: poll with backoff only) "
        "[env RECALL_WORKER_WAIT_SECONDS]",
    )
    add(
        "--retry-max",
        type=_positive_float,
        default=_env("RECALL_WORKER_RETRY_MAX", "30"),
        metavar="SECONDS",
        help="longest pause between retries of a failed call (default 30; "
        "heartbeats retry within their interval) [env RECALL_WORKER_RETRY_MAX]",
    )
    add(
        "--http-timeout",
        type=_positive_float,
        default=_env("RECALL_WORKER_HTTP_TIMEOUT", "30"),
        metavar="SECONDS",
        help="timeout of one API request (default 30) [env RECALL_WORKER_HTTP_TIMEOUT]",
    )
    add(
        "--shutdown-grace",
        type=_non_negative_float,
        default=_env("RECALL_WORKER_SHUTDOWN_GRACE", "30"),
        metavar="SECONDS",
        help="after SIGTERM, how long to keep trying to release leases and send "
        "finished results (default 30) [env RECALL_WORKER_SHUTDOWN_GRACE]",
    )
    add(
        "--log-level",
        default=_env("RECALL_WORKER_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="DEBUG also logs every heartbeat (default INFO) "
        "[env RECALL_WORKER_LOG_LEVEL]",
    )
    add("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


# --- The token out of engines' reach (Linux) ------------------------------------
#
# An engine runs as the worker's user, so without more it could read the token
# where the kernel keeps it: /proc/<worker>/environ (the environment the worker
# was started with, which os.environ changes never rewrite), /proc/<worker>/mem,
# or by attaching a debugger. Once the token is read, the worker makes itself
# non-dumpable (those files then belong to root, and only a process with
# CAP_SYS_PTRACE may open them or attach), removes the token from its
# environment and overwrites its bytes in the initial environment block. The
# engine's own environment never had it (PRIVATE_ENV_PREFIXES).

PR_SET_DUMPABLE = 4  # linux/prctl.h
TOKEN_VARIABLES = ("RECALL_TOKEN",)


def hide_token_from_engines() -> list[str]:
    """Make the token unreadable to other processes of this user; what was
    done, for the start-up log. Outside Linux only the variable is removed."""
    done = []
    if scrub_environment(TOKEN_VARIABLES):
        done.append("token scrubbed from the environment")
    prctl = _prctl()
    if prctl is not None and prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0:
        done.append("not dumpable")
    return done


def scrub_environment(names: tuple[str, ...]) -> bool:
    """Remove ``names`` from the environment, and on Linux overwrite their
    values in the environment block the process started with (what
    /proc/<pid>/environ shows, whatever os.environ says since). True if any
    was there."""
    present = [name for name in names if name in os.environ]
    if sys.platform.startswith("linux") and present:
        with contextlib.suppress(OSError, ValueError, IndexError):
            _overwrite_initial_environment(present)
    for name in present:
        os.environ.pop(name, None)  # also unsetenv(): gone from libc's environ
    return bool(present)


def _overwrite_initial_environment(names: list[str]) -> None:
    """Zero the values of ``names`` in [env_start, env_end) of this process
    (fields 50 and 51 of /proc/self/stat): the bytes /proc/<pid>/environ
    reads. Only whole entries (after a NUL or at the start) match."""
    with open("/proc/self/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])
    if not 0 < start < end:
        return
    block = ctypes.string_at(start, end - start)
    prefixes = tuple(name.encode() + b"=" for name in names)
    offset = 0
    for entry in block.split(b"\0"):
        if entry.startswith(prefixes):
            value = offset + entry.index(b"=") + 1
            ctypes.memset(start + value, 0, offset + len(entry) - value)
        offset += len(entry) + 1


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str]:
    """Parse and check the options; return them with the token."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("set the server's URL: --url or RECALL_URL")
    parsed = urllib.parse.urlsplit(args.url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        parser.error(f"--url must be an http:// or https:// URL, not {args.url!r}")
    token = args.token
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as error:
            parser.error(f"cannot read --token-file: {error}")
    if not token:
        parser.error("set the worker token: RECALL_TOKEN, --token-file or --token")
    if not token.isascii() or not token.isprintable() or " " in token:
        parser.error("the worker token must be printable ASCII without spaces")
    if not args.simulate and not args.command:
        parser.error("choose an engine: --command TEMPLATE or --simulate")
    if args.command:
        try:
            argv0 = check_template(args.command)[0]
        except ValueError as error:
            parser.error(f"--command: {error}")
        if "{" not in argv0 and shutil.which(argv0) is None:
            parser.error(f"--command: {argv0!r} is not an executable on PATH")
    # The command line's labels, else the environment's (comma-separated).
    pairs = args.label or _env("RECALL_WORKER_LABELS", "").split(",")
    try:
        args.labels = parse_labels(pairs)
    except ValueError as error:
        parser.error(f"--label: {error}")
    if args.poll_min > args.poll_max:
        parser.error("--poll-min must not be larger than --poll-max")
    if args.source_root and not os.path.isdir(args.source_root):
        parser.error(f"--source-root: {args.source_root!r} is not a directory")
    return args, token


def main(argv: list[str] | None = None) -> int:
    args, token = parse_args(argv)
    on_command_line = not args.token_file and args.token not in (
        None,
        os.environ.get("RECALL_TOKEN"),
    )
    hidden = hide_token_from_engines()
    configure_logging(args.log_level, token)
    if warning := plain_http_warning(args.url):
        log.warning("%s", warning)
    if on_command_line:
        log.warning(
            "the token is on the command line, where every user of this machine "
            "can read it (/proc/%d/cmdline): use RECALL_TOKEN or --token-file",
            os.getpid(),
        )
    if hidden:
        log.debug("token kept from engines: %s", ", ".join(hidden))
    registry = ProcessRegistry()
    if args.simulate:
        engine: Engine = SimulateEngine(
            factor=args.simulate_factor,
            fail_rate=args.simulate_fail_rate,
            default_duration=args.simulate_default_duration,
        )
    else:
        engine = CommandEngine(
            args.command,
            timeout=args.timeout or None,
            non_retryable=args.non_retryable_exit_codes,
            workdir=args.workdir,
            registry=registry,
        )
    settings = Settings(
        poll_min=args.poll_min,
        poll_max=args.poll_max,
        http_timeout=args.http_timeout,
        wait_seconds=args.wait_seconds,
        source_root=SourceRoot(args.source_root) if args.source_root else None,
        labels=args.labels,
    )
    api = Api(args.url, token, timeout=args.http_timeout, retry_cap=args.retry_max)
    shutdown = Shutdown(args.shutdown_grace)
    install_signal_handlers(shutdown, registry)
    log.info(
        "recall-worker %s: url=%s engine=%s concurrency=%d source-root=%s labels=%s",
        __version__,
        safe_url(args.url),
        engine.name,
        args.concurrency,
        settings.source_root.root if settings.source_root else "none",
        ",".join(f"{k}={v}" for k, v in settings.labels.items()) or "none",
    )
    forms = ServerForms()
    heartbeats = Heartbeats(api, forms, shutdown)
    completions = Completions(api, forms, shutdown.grace_over)
    claimer = Claimer(
        args.concurrency, api=api, settings=settings, shutdown=shutdown, forms=forms
    )
    slots = [
        Slot(
            n,
            api=api,
            engine=engine,
            settings=settings,
            shutdown=shutdown,
            claimer=claimer,
            heartbeats=heartbeats,
            completions=completions,
        )
        for n in range(1, args.concurrency + 1)
    ]
    heartbeats.start()
    claimer.start()
    for slot in slots:
        slot.start()
    join_all([*slots, claimer])
    for job in claimer.leftovers():  # claimed while stopping, never started
        release(api, job, shutdown)
        REDACTOR.discard(job.lease_token)
    heartbeats.stop()
    log.info("stopped (exit %d)", shutdown.exit_code)
    return shutdown.exit_code


def join_all(threads: list[threading.Thread]) -> None:
    """Join threads in short waits, so signal handlers run on the main thread."""
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)


def install_signal_handlers(shutdown: Shutdown, registry: ProcessRegistry) -> None:
    """First SIGTERM/SIGINT: stop gracefully. Second: kill engines, exit now."""

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if shutdown.request(f"{name} received"):
            return
        registry.kill_all()
        sys.stderr.write(f"recall-worker: second {name} while stopping: exiting now\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


if __name__ == "__main__":
    sys.exit(main())
