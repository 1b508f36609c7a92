"""Worker JSON API v1 (paths and shapes are a contract: workers depend on them).

Every endpoint is POST, authenticated by ``Authorization: Bearer <worker token>``
(never by session cookie, so CSRF does not apply), and answers JSON. Every error
is ``{"error": <code>, "detail": <sentence>}``; bad input is a 4xx, never a 500.
Views only parse and validate; the transitions live in ``jobs.transitions``.
A request's time is the database's, read with the worker's token.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from functools import wraps
from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from api import worker_limits
from api.jsonapi import (
    ApiError,
    bad_request,
    error_response,
    field,
    json_object_body,
    json_type,
)
from api.jsonapi import _check_values as _check_values  # the reference worker's tests
from api.request_metrics import count_request, observed
from api.waiter import (
    KEEP_WAITING,
    MAX_WAIT_SECONDS,
    WAITER_KEY,
    ClaimRequest,
    Waiter,
)
from batches.labels import LabelError, Labels, clean_labels
from batches.numbers import is_number, shown
from jobs import transitions
from jobs.exceptions import LeaseLost, TooManyLeases, WorkerDisabled
from jobs.models import Job, Worker
from jobs.tokens import MAX_TOKEN_LENGTH
from jobs.transitions.rules import (
    COMPLETED,
    MAX_COMPLETIONS,
    MAX_HEARTBEAT_LEASES,
    heartbeat_interval,
    max_leases,
)

log = logging.getLogger("recall.api")

MAX_DB_ID = 2**63 - 1
# The most jobs one claim may ask for (``"max_jobs"``).
MAX_JOBS_PER_CLAIM = 32
# Segment times are seconds of audio: about 115 days is the most that makes sense
# (and keeps every export's arithmetic far from overflowing).
MAX_SEGMENT_SECONDS = 10_000_000


def worker_endpoint(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """POST only, worker token auth, JSON object body; domain errors to JSON."""

    @csrf_exempt
    @wraps(view)
    def wrapper(request: HttpRequest, **kwargs: Any) -> HttpResponse:
        try:
            if request.method != "POST":
                raise ApiError(
                    405,
                    "method_not_allowed",
                    f"{request.method} is not allowed here; use POST.",
                    {"Allow": "POST"},
                )
            worker, now = authenticate(request)
            throttle(worker)
            body = json_object_body(request)
            transitions.touch_worker(worker, now=now)
            return view(request, worker, body, now=now, **kwargs)
        except ApiError as error:
            return error.response()
        except LeaseLost as error:
            job_id = kwargs.get("job_id")
            if job_id is not None and not Job.objects.filter(pk=job_id).exists():
                return _no_such_job(job_id).response()
            return error_response(409, "lease_lost", str(error))
        except TooManyLeases as error:
            return error_response(
                429,
                "too_many_leases",
                str(error),
                {"Retry-After": str(heartbeat_interval())},
            )
        except WorkerDisabled as error:  # disabled after it was authenticated
            return error_response(403, "forbidden", str(error))
        # A lost database connection becomes a 503 in DatabaseUnavailableMiddleware.

    return observed(wrapper)


def bearer_token(authorization: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or ''."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def authenticate(request: HttpRequest) -> tuple[Worker, datetime]:
    """The worker making the request, and the request's time (the database's)."""
    # From the WSGI environ, as ``request.headers`` reads it: building that
    # mapping of every header cost about 100,000 instructions a request (7%).
    token = bearer_token(request.META.get("HTTP_AUTHORIZATION", ""))
    if not token:
        raise ApiError(
            401,
            "unauthorized",
            "Send the worker token as 'Authorization: Bearer <token>'.",
            {"WWW-Authenticate": 'Bearer realm="recall"'},
        )
    worker, now = transitions.authenticate_worker(token)
    if worker is None or now is None:
        raise ApiError(
            401,
            "unauthorized",
            "Unknown worker token.",
            {"WWW-Authenticate": 'Bearer realm="recall", error="invalid_token"'},
        )
    if not worker.is_active:
        raise ApiError(403, "forbidden", f"Worker {worker.name!r} is disabled.")
    return worker, now


def throttle(worker: Worker) -> None:
    """Refuse a request of a worker past its rate (``RECALL_WORKER_RATE_PER_SECOND``
    in bursts of up to ``RECALL_WORKER_RATE_BURST``, counted by the whole
    server: ``api/worker_limits.py``) with 429 ``rate_limited``, before it
    costs more than its authentication."""
    rate = settings.RECALL_WORKER_RATE_PER_SECOND
    burst = settings.RECALL_WORKER_RATE_BURST
    wait = worker_limits.take_request(worker.pk, rate=rate, burst=burst)
    if wait:
        raise ApiError(
            429,
            "rate_limited",
            f"Worker {worker.name!r} is over its request rate ({rate:g} a second, "
            f"in bursts of up to {burst}): retry after Retry-After seconds.",
            {"Retry-After": str(max(1, math.ceil(wait)))},
        )


def _lease_token(body: dict) -> str:
    token = field(body, "lease_token", str)
    if not token or len(token) > MAX_TOKEN_LENGTH:
        raise bad_request(
            f"Field 'lease_token' must be 1 to {MAX_TOKEN_LENGTH} characters."
        )
    return token


def _leases(body: dict) -> list[tuple[int, str]]:
    """A batched heartbeat's leases: 1 to MAX_HEARTBEAT_LEASES objects of
    exactly ``job_id`` (an integer) and ``lease_token``, the job ids distinct."""
    leases = field(body, "leases", list)
    if not 1 <= len(leases) <= MAX_HEARTBEAT_LEASES:
        raise bad_request(
            f"Field 'leases' must hold 1 to {MAX_HEARTBEAT_LEASES} leases, "
            f"not {len(leases)}."
        )
    pairs: list[tuple[int, str]] = []
    seen: set[int] = set()
    for n, entry in enumerate(leases):
        if not isinstance(entry, dict) or entry.keys() != {"job_id", "lease_token"}:
            raise bad_request(
                f"leases[{n}] must be an object with exactly the fields 'job_id' "
                f"and 'lease_token'."
            )
        job_id, token = entry["job_id"], entry["lease_token"]
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise bad_request(
                f"leases[{n}].job_id must be an integer, not {json_type(job_id)}."
            )
        if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_LENGTH:
            raise bad_request(
                f"leases[{n}].lease_token must be a string of 1 to "
                f"{MAX_TOKEN_LENGTH} characters."
            )
        if job_id in seen:
            raise bad_request(f"leases[{n}] names job {job_id} again.")
        seen.add(job_id)
        pairs.append((job_id, token))
    return pairs


def _result(body: dict) -> dict:
    result = field(body, "result", dict)
    if not isinstance(result.get("text"), str):
        raise bad_request("Field 'result' must have a string 'text'.")
    if "language" in result and not isinstance(result["language"], str):
        raise bad_request("Field 'result.language' must be a string.")
    if "segments" in result:
        segments = result["segments"]
        if not isinstance(segments, list):
            raise bad_request("Field 'result.segments' must be an array.")
        for n, segment in enumerate(segments):
            if not (
                isinstance(segment, dict)
                and is_number(segment.get("start"))
                and is_number(segment.get("end"))
                and isinstance(segment.get("text"), str)
                and 0 <= segment["start"] <= segment["end"] <= MAX_SEGMENT_SECONDS
            ):
                raise bad_request(
                    f"result.segments[{n}] must be an object with finite numbers "
                    f"0 <= 'start' <= 'end' <= {MAX_SEGMENT_SECONDS} (seconds) "
                    f"and a string 'text'."
                )
    return result


def _completions(body: dict) -> list[tuple[int, str, dict]]:
    """A batched completion's entries: 1 to MAX_COMPLETIONS objects of exactly
    ``job_id`` (an integer), ``lease_token`` and ``result`` (each as the single
    completion requires them), the job ids distinct. Any entry that breaks
    these is a 400 for the whole call, before anything is written."""
    entries = field(body, "results", list)
    if not 1 <= len(entries) <= MAX_COMPLETIONS:
        raise bad_request(
            f"Field 'results' must hold 1 to {MAX_COMPLETIONS} completions, "
            f"not {len(entries)}."
        )
    checked: list[tuple[int, str, dict]] = []
    seen: set[int] = set()
    for n, entry in enumerate(entries):
        fields = {"job_id", "lease_token", "result"}
        if not isinstance(entry, dict) or entry.keys() != fields:
            raise bad_request(
                f"results[{n}] must be an object with exactly the fields 'job_id', "
                f"'lease_token' and 'result'."
            )
        job_id = entry["job_id"]
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise bad_request(
                f"results[{n}].job_id must be an integer, not {json_type(job_id)}."
            )
        if job_id in seen:
            raise bad_request(f"results[{n}] names job {job_id} again.")
        seen.add(job_id)
        try:
            checked.append((job_id, _lease_token(entry), _result(entry)))
        except ApiError as error:
            raise bad_request(f"results[{n}]: {error.detail}") from None
    return checked


def _wait_seconds(body: dict) -> float:
    """How long a claim may wait for work: a number from 0 to 60 (0: answer now)."""
    value = body.get("wait_seconds", 0)
    if not is_number(value) or not 0 <= value <= MAX_WAIT_SECONDS:
        given = shown(value) if is_number(value) else json_type(value)
        raise bad_request(
            f"Field 'wait_seconds' must be a number from 0 to {MAX_WAIT_SECONDS}, "
            f"not {given}."
        )
    return float(value)


def _job(job_id: int) -> int:
    """The job to act on, unread: the transition reads it under its lock, and an
    unknown id turns out a 404 only when the transition fails (one query less
    per call on the hot path)."""
    if job_id > MAX_DB_ID:
        raise _no_such_job(job_id)
    return job_id


def _no_such_job(job_id: int) -> ApiError:
    return ApiError(404, "not_found", f"There is no job {job_id}.")


# --- Endpoints ---------------------------------------------------------------------


@worker_endpoint
def claim(request: HttpRequest, worker: Worker, body: dict, *, now) -> HttpResponse:
    wait = _wait_seconds(body)
    labels, max_jobs = _labels(body), _max_jobs(body)
    # The claim enforces the cap (in its own transaction); a worker that held
    # that many when it was authenticated is refused without trying.
    cap = max_leases()
    if worker.live_leases >= cap:
        raise TooManyLeases(worker.name, worker.live_leases, cap)
    # Asked to wait and the server can hold the request without a thread
    # (api/waiter.py): it keeps the 204 and, when work it can take may have
    # come, claims again with claims_for_waiting (below), or sends the 204
    # when the wait is over. If its probe found nothing a moment ago, it waits
    # for the next. A worker with RECALL_MAX_WAITING_CLAIMS_PER_WORKER claims
    # waiting already is answered at once, as if it had not asked to wait.
    waiter = request.META.get(WAITER_KEY)
    if not isinstance(waiter, Waiter) or not wait:
        waiter = None
    limit = settings.RECALL_MAX_WAITING_CLAIMS_PER_WORKER
    # What a parked claim keeps.
    kept = ClaimRequest(wait_seconds=wait, labels=labels, max_jobs=max_jobs)
    if waiter and waiter.quiet:
        if waiter.park(wait, kept, worker=worker.pk, limit=limit):
            return HttpResponse(status=204)
        waiter = None  # the wait is over, or the worker may not wait more
    answer = _claim(worker, kept, now=now, cap=cap)
    if answer is None:
        if waiter:
            waiter.park(wait, kept, worker=worker.pk, limit=limit)
        return HttpResponse(status=204)
    return JsonResponse(answer)


def _claim(
    worker: Worker, request: ClaimRequest, *, now: datetime | None, cap: int
) -> dict[str, Any] | None:
    """Claim as ``request`` asks: the answer's JSON object, or None (a 204)."""
    if request.max_jobs is None:
        job = transitions.claim_next(
            worker, labels=request.labels, now=now, max_leases=cap
        )
        return None if job is None else claimed(job)
    jobs = transitions.claim_many(
        worker,
        labels=request.labels,
        max_jobs=request.max_jobs,
        now=now,
        max_leases=cap,
    )
    return {"jobs": [claimed(job)["job"] for job in jobs]} if jobs else None


def _labels(body: dict) -> Labels:
    """The labels the claim declares (no field: none), by ``batches.labels``'
    rules; null is refused like any other non-object."""
    value = body.get("labels", {})
    try:
        if value is None:  # clean_labels' "no labels": not a JSON form of them
            raise LabelError("Field 'labels' must be an object of KEY: VALUE strings")
        return clean_labels(value, what="Field 'labels'")
    except LabelError as error:
        raise bad_request(f"{error}.") from None


def _max_jobs(body: dict) -> int | None:
    """How many jobs the claim takes at most (an integer from 1 to
    ``MAX_JOBS_PER_CLAIM``), or None: a single claim, answered as one."""
    if "max_jobs" not in body:
        return None
    value = body["max_jobs"]
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_JOBS_PER_CLAIM
    ):
        given = shown(value) if is_number(value) else json_type(value)
        raise bad_request(
            f"Field 'max_jobs' must be an integer from 1 to {MAX_JOBS_PER_CLAIM}, "
            f"not {given}."
        )
    return value


def claims_for_waiting(
    waiting: Iterable[tuple[str, ClaimRequest | None]],
) -> Iterator[bytes | None]:
    """Claim for waiting (parked) long-poll claims, woken because the server's
    probe found work they may take: for each ``(Authorization header, kept
    parameters)``, in order, the JSON body of its 200; None when the claim
    view itself must answer it (its worker is unknown, disabled or at its
    lease cap by now: a 401, 403 or 429; the cap is the claim's own, so a
    worker with many waiting claims gets no more than its cap from one wave);
    or ``KEEP_WAITING`` when it found nothing it can take: it waits on. A
    claim whose labels offer no more than those of one that found nothing
    (the same or fewer pairs: it can serve no batch that one could not) is
    not tried (it waits on); the others are, as work one worker cannot take
    another may: at most one claim finds nothing per set of labels.

    Each claim is the view's (the worker's authentication, then its claim,
    its own transaction), on the caller's thread, without running the request
    through HTTP parsing and middleware again, and the workers are read in one
    statement: for a wave of hundreds of waiting workers that was most of the
    cost (BENCHMARKS.md, row 15).
    """
    cap = max_leases()
    waiting = list(waiting)
    tokens = [bearer_token(authorization) for authorization, _ in waiting]
    found_nothing: list[Labels] = []  # the labels of claims that found nothing
    workers = transitions.authenticate_workers(tokens)
    for (worker, now), (_, kept) in zip(workers, waiting, strict=True):
        request = kept or ClaimRequest(wait_seconds=0)
        started = time.perf_counter()
        if (
            worker is None
            or now is None
            or not worker.is_active
            or worker.live_leases >= cap
        ):
            yield None
            continue
        if any(request.labels.items() <= other.items() for other in found_nothing):
            yield KEEP_WAITING
            continue
        transitions.touch_worker(worker, now=now)
        # Each claim on its own statement's clock: the workers were read
        # together, the claims come one after another (and each counts the
        # worker's leases again: an earlier claim of this wave may have been
        # its own).
        try:
            answer = _claim(worker, request, now=None, cap=cap)
        except (TooManyLeases, WorkerDisabled):
            yield None
            continue
        if answer is None:
            found_nothing.append(dict(request.labels))
            yield KEEP_WAITING
            continue
        # The bytes JsonResponse(...).content holds, without building the
        # response around them (a third less work for the body).
        body = json.dumps(answer, cls=DjangoJSONEncoder).encode()
        count_request("claim", 200, time.perf_counter() - started)
        yield body


def claimed(job: Job) -> dict[str, Any]:
    """A claim's answer: the leased job, with what its worker needs to do it."""
    expires = job.lease_expires_at
    if expires is None:  # a leased job always has one (a check constraint)
        raise RuntimeError(f"job {job.pk} was leased without an expiry")
    return {
        "job": {
            "id": job.pk,
            "lease_token": job.lease_token,
            "lease_expires_at": expires.isoformat(),
            "lease_seconds": settings.RECALL_LEASE_SECONDS,
            "heartbeat_interval": heartbeat_interval(),
            "attempt": job.attempts,
            "max_attempts": job.max_attempts,
            "batch": {"id": job.batch.pk, "name": job.batch.name},
            "item": {
                "id": job.item.pk,
                "source": job.item.source,
                "params": job.item.params,
                # Additive to the v1 shape: from the manifest, null if unknown.
                "duration_seconds": job.item.duration_seconds,
            },
        }
    }


@worker_endpoint
def heartbeat(
    request: HttpRequest, worker: Worker, body: dict, *, now, job_id: int
) -> HttpResponse:
    token = _lease_token(body)
    expires = transitions.heartbeat(_job(job_id), token, worker=worker, now=now)
    return JsonResponse({"lease_expires_at": expires.isoformat()})


@worker_endpoint
def heartbeat_many(
    request: HttpRequest, worker: Worker, body: dict, *, now
) -> HttpResponse:
    """All of a worker's leases in one call, each judged as ``heartbeat`` would
    judge it alone: a lost one never stops the others being renewed."""
    leases = _leases(body)
    answers = transitions.heartbeat_many(leases, worker=worker, now=now)
    return JsonResponse(
        {
            "leases": [
                {"job_id": job_id, "lease_expires_at": answer.isoformat()}
                if isinstance(answer, datetime)
                else {"job_id": job_id, "error": answer}
                for (job_id, _), answer in zip(leases, answers, strict=True)
            ]
        }
    )


@worker_endpoint
def complete(
    request: HttpRequest, worker: Worker, body: dict, *, now, job_id: int
) -> HttpResponse:
    token, result = _lease_token(body), _result(body)
    transitions.complete(_job(job_id), token, worker=worker, result=result, now=now)
    return JsonResponse({"status": "completed"})


@worker_endpoint
def complete_many(
    request: HttpRequest, worker: Worker, body: dict, *, now
) -> HttpResponse:
    """Several results in one call (a worker with several GPUs), each judged
    as ``complete`` would judge it alone (a replay is completed again): a
    lost lease never stops the others being completed."""
    completions = _completions(body)
    outcomes = transitions.complete_many(completions, worker=worker, now=now)
    return JsonResponse(
        {
            "results": [
                {"job_id": job_id, "status": COMPLETED}
                if outcome == COMPLETED
                else {"job_id": job_id, "error": outcome}
                for (job_id, _, _), outcome in zip(completions, outcomes, strict=True)
            ]
        }
    )


@worker_endpoint
def fail(
    request: HttpRequest, worker: Worker, body: dict, *, now, job_id: int
) -> HttpResponse:
    token = _lease_token(body)
    error = field(body, "error", str)
    retryable = field(body, "retryable", bool, required=False, default=True)
    status = transitions.fail(
        _job(job_id), token, worker=worker, error=error, retryable=retryable, now=now
    )
    return JsonResponse({"status": status})


@worker_endpoint
def release(
    request: HttpRequest, worker: Worker, body: dict, *, now, job_id: int
) -> HttpResponse:
    token = _lease_token(body)
    transitions.release(_job(job_id), token, worker=worker, now=now)
    return JsonResponse({"status": "queued"})


@csrf_exempt  # a POST to a wrong path is a 404, not a CSRF failure
def not_found(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    return error_response(404, "not_found", f"No API endpoint at {request.path}.")
