"""Webhook delivery: attempts over HTTP, and the dispatcher that keeps time.

Each event row has one delivery per subscribed endpoint (``jobs.transitions``
writes them with the event). An attempt is:

1. claimed by compare-and-set under a lease (``claim_webhook_deliveries``), in
   a short transaction: two processes never make the same attempt at once, and
   an attempt whose process is killed is made again once its lease runs out,
   with the same ``webhook-id``;
2. sent, outside any transaction: the destination checked again (DNS may have
   changed), a connection to one of the checked addresses (no second lookup),
   a signed POST, no redirect followed, everything within
   ``RECALL_WEBHOOK_TIMEOUT_SECONDS``;
3. recorded (``record_webhook_attempt``): delivered on a 2xx; on anything else
   due again after the next delay of ``RECALL_WEBHOOK_RETRY_SECONDS``, until
   they run out; a 410 disables the endpoint.

Timing. A first attempt is queued for the cluster when the event commits
(``deliver_webhooks``). Retries need a clock: django-q2's scheduler looks only
every 30 s and schedules no more often than every minute. So a dispatcher
(``dispatch_webhooks``: scheduled every minute, and also what a first-attempt
task becomes) stays while an attempt falls due within ``HORIZON`` (longer than
the gap between two scheduled runs) and looks every second. After ``BUDGET``
seconds it queues its successor and stops: the successor alone may take over
(scheduled runs stand aside meanwhile), so retries stay on time without one
task holding a cluster worker for minutes. One dispatcher at a time holds a
lease on the database's clock; a killed one's lease runs out, and a successor
that never starts stops counting after ``HANDOVER_STALE``.

A cluster starting queues a dispatcher that stands by (``standby``): the lease
it finds held may be a killed cluster's, which nobody will release, so it waits
for that lease to run out and takes over, unless the holder renews it (alive:
it covers the retries). A dispatcher that is only waiting for its next look
holds a short lease (``IDLE_LEASE``), so a killed one's runs out within
seconds, before the attempt it was waiting for is due again; only over a round
of attempts does it hold one as long as an attempt's.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django_q.tasks import async_task

from engine.webhooks.destinations import Destination, DestinationRefused, resolve
from engine.webhooks.signing import signature_header
from jobs import transitions
from jobs.models import DeliveryStatus, WebhookDelivery, WebhookDispatch, url_origin
from jobs.transitions import Claimed, Outcome
from jobs.webhook_keys import SecretUnreadable

log = logging.getLogger("recall.webhooks")

# A dispatcher stays while an attempt falls due within this long: more than the
# longest gap between two scheduled runs (a minute, plus up to 30 s late).
HORIZON = timedelta(seconds=120)
# Seconds one dispatcher run lasts at most before it hands over to a successor
# it queues (less than the schedule's minute: a single cluster worker keeps up).
BUDGET = 50.0
# The successor's task.
DISPATCH_TASK = "engine.tasks.dispatch_webhooks"
# How often a staying dispatcher looks for due attempts.
POLL_SECONDS = 1.0
# The dispatcher's lease while it waits between two looks: a few looks long, so
# that a killed dispatcher's lease runs out within seconds of the kill.
IDLE_LEASE = timedelta(seconds=5 * POLL_SECONDS)
# Attempts one process makes at once.
PARALLEL = 8
# An attempt's lease: its timeout plus this, for the lookup and the writes.
LEASE_GRACE = timedelta(seconds=15)
# Bytes of a response body kept with the attempt.
EXCERPT_BYTES = 1024
USER_AGENT = "Recall-Webhooks/1"


@dataclass
class Report:
    delivered: int = 0
    retrying: int = 0
    gave_up: int = 0
    lost: int = 0  # the lease ran out first: another process took over

    def add(self, other: Report) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def attempt_lease() -> timedelta:
    return timedelta(seconds=settings.RECALL_WEBHOOK_TIMEOUT_SECONDS) + LEASE_GRACE


# --- One round of attempts -----------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """An attempt ready to send: no database access needed any more."""

    url: str
    body: bytes
    headers: dict[str, str]
    error: str = ""  # set when it cannot be sent at all


def deliver(ids: Sequence[int] | None = None, *, now: datetime | None = None) -> Report:
    """Claim what is due now (of ``ids`` only, if given), send it, record it.

    ``now`` fixes the clock (tests); otherwise the database's is read when
    claiming and again when recording.
    """
    report = Report()
    claimed = transitions.claim_webhook_deliveries(
        now=now, limit=PARALLEL, lease=attempt_lease(), ids=ids
    )
    if not claimed:
        return report
    at = transitions.now() if now is None else now
    requests = [_request(c, at) for c in claimed]
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        outcomes = list(pool.map(send, requests))
    for c, outcome in zip(claimed, outcomes, strict=True):
        status = transitions.record_webhook_attempt(c, outcome, now=now)
        _log(c, outcome, status)
        if status is None:
            report.lost += 1
        elif status == DeliveryStatus.DELIVERED:
            report.delivered += 1
        elif status == DeliveryStatus.PENDING:
            report.retrying += 1
        else:
            report.gave_up += 1
    return report


def _request(claimed: Claimed, now: datetime) -> Request:
    delivery = claimed.delivery
    event, endpoint = delivery.event, delivery.endpoint
    body = event.body.encode()
    timestamp = int(now.timestamp())
    try:
        secrets = transitions.webhook_signing_secrets(endpoint, now=now)
    except SecretUnreadable as error:
        return Request(endpoint.url, body, {}, error=str(error))
    return Request(
        url=endpoint.url,
        body=body,
        headers={
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "webhook-id": event.webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature_header(
                secrets, event.webhook_id, timestamp, body
            ),
        },
    )


def _log(claimed: Claimed, outcome: Outcome, status: str | None) -> None:
    delivery = claimed.delivery
    log.log(
        logging.INFO if outcome.delivered else logging.WARNING,
        "webhook %s to %s, attempt %s: %s -> %s",
        delivery.event.webhook_id,
        delivery.endpoint,  # its id and origin: the URL may hold credentials
        claimed.number,
        outcome.status_code or outcome.error,
        status or "lease lost",
        extra={"batch": delivery.event.batch_id},
    )


# --- HTTP ------------------------------------------------------------------------


def send(request: Request) -> Outcome:
    """POST the request, within the timeout in all; never raises."""
    timeout = float(settings.RECALL_WEBHOOK_TIMEOUT_SECONDS)
    started = time.monotonic()

    def took() -> int:
        return round((time.monotonic() - started) * 1000)

    if request.error:
        return Outcome(None, took(), error=request.error)
    try:
        destination = resolve(request.url)
    except DestinationRefused as refused:
        return Outcome(None, took(), error=f"Destination refused: {refused}")
    deadline = started + timeout
    try:
        status, excerpt = _post(destination, request, deadline)
    except _TimedOut:
        return Outcome(None, took(), error=f"Timed out after {timeout:g} s.")
    except (OSError, http.client.HTTPException) as error:
        reason = str(error) or type(error).__name__
        return Outcome(None, took(), error=f"Connection failed: {reason}")
    except Exception as error:  # a bug must not lose the other attempts' outcomes
        log.exception(
            "webhook attempt to %s failed unexpectedly", url_origin(request.url)
        )
        return Outcome(None, took(), error=f"Unexpected error: {error!r}")
    return Outcome(status, took(), excerpt=excerpt)


class _TimedOut(Exception):
    pass


def _post(
    destination: Destination, request: Request, deadline: float
) -> tuple[int, str]:
    """Connect to the first checked address that answers, then POST; all of
    it (TLS handshake included) cut off at ``deadline``, so a receiver that
    drips bytes cannot hold an attempt, and its lease, for longer."""
    timed_out = threading.Event()
    opened: list[http.client.HTTPConnection] = []

    def abort() -> None:
        timed_out.set()
        for candidate in opened:
            if candidate.sock is not None:
                with contextlib.suppress(OSError):
                    candidate.sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), abort)
    timer.start()
    try:
        connection = None
        failure: OSError | None = None
        for address in destination.addresses:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _TimedOut
            candidate = _connection(destination, address, remaining)
            opened.append(candidate)
            try:
                candidate.connect()
            except OSError as error:
                if timed_out.is_set() or isinstance(error, TimeoutError):
                    raise _TimedOut from error
                failure = error
                continue
            connection = candidate
            break
        if connection is None:
            raise failure or OSError("no address to connect to")
        connection.request(
            "POST", destination.target, body=request.body, headers=request.headers
        )
        response = connection.getresponse()
        excerpt = response.read(EXCERPT_BYTES).decode("utf-8", "replace")
        return response.status, excerpt
    except (OSError, http.client.HTTPException) as error:
        if timed_out.is_set() or isinstance(error, TimeoutError):
            raise _TimedOut from error
        raise
    finally:
        timer.cancel()
        for candidate in opened:
            candidate.close()


class _PinnedHTTP(http.client.HTTPConnection):
    """A connection to one checked address, asking for the URL's host."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """TLS to one checked address; the certificate is verified for the host."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        self.tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self.tls)
        self.address = address

    def connect(self) -> None:
        raw = socket.create_connection((self.address, self.port), self.timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = raw  # so that the deadline can cut the handshake short
        self.sock = self.tls.wrap_socket(raw, server_hostname=self.host)


def _connection(
    destination: Destination, address: str, timeout: float
) -> http.client.HTTPConnection:
    kind = _PinnedHTTPS if destination.scheme == "https" else _PinnedHTTP
    return kind(destination.host, destination.port, address, timeout)


# --- The dispatcher ---------------------------------------------------------------


def dispatch(
    ids: Sequence[int] | None = None,
    *,
    handover: str = "",
    budget: float = BUDGET,
    standby: bool = False,
) -> Report:
    """Deliver ``ids`` now (first attempts), then act as the dispatcher while
    an attempt falls due within ``HORIZON``. Returns at once when another
    dispatcher holds the lease, or a successor is awaited (``handover`` is the
    successor's token): they cover the rest. With ``standby`` (a cluster
    starting), a held lease may be a killed cluster's: it waits for that lease
    to run out and takes over, unless its holder renews it (alive). After
    ``budget`` seconds, with attempts still due soon, it queues its successor
    and stops, so one cluster worker is never held for long and other tasks
    (the sweep) run in between."""
    started = time.monotonic()
    report = Report()
    if ids:
        report.add(deliver(ids))
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    ttl = attempt_lease() + timedelta(seconds=POLL_SECONDS)
    seen: Lease | None = None  # the lease another holds, as last seen
    while True:
        if not transitions.acquire_webhook_dispatcher(
            owner, ttl=ttl, handover=handover
        ):
            if not standby:
                break
            lease = _held_lease()
            if lease is None or (seen is not None and lease != seen):
                break  # a successor is awaited, or the holder is alive
            if seconds_until_due() is None or time.monotonic() - started >= budget:
                break
            seen = lease
            time.sleep(POLL_SECONDS)
            continue
        handover, seen = "", None
        try:
            while (wait := _deliver_due(report)) is not None:
                if time.monotonic() - started >= budget:
                    _hand_over(owner)
                    return report
                # Between two looks, a short lease (a kill lets it run out
                # soon); before attempts fall due, one that outlasts them. A
                # lease lost meanwhile (this process stalled) is another's now.
                if not transitions.acquire_webhook_dispatcher(owner, ttl=IDLE_LEASE):
                    break
                time.sleep(min(POLL_SECONDS, wait))
                if wait <= POLL_SECONDS and not transitions.acquire_webhook_dispatcher(
                    owner, ttl=ttl
                ):
                    break
        finally:
            transitions.release_webhook_dispatcher(owner)
        # Another process may have found the lease held just before the
        # release and left its retry to us: look once more.
        if seconds_until_due() is None:
            break
    return report


Lease = tuple[str, datetime | None]  # (holder, until)


def _held_lease() -> Lease | None:
    """The dispatcher's lease as another holds it (holder, until), or None
    if instead a successor is awaited."""
    state = WebhookDispatch.objects.filter(pk=WebhookDispatch.SINGLETON).first()
    if state is None or state.handover:
        return None
    return (state.locked_by, state.locked_until)


def _deliver_due(report: Report) -> float | None:
    report.add(deliver())
    return seconds_until_due()


def _hand_over(owner: str) -> None:
    token = uuid.uuid4().hex
    if transitions.hand_over_webhook_dispatcher(owner, token):
        async_task(DISPATCH_TASK, handover=token)


def seconds_until_due() -> float | None:
    """Seconds until the next attempt falls due, if within ``HORIZON``."""
    due = WebhookDelivery.objects.next_due_at()
    if due is None:
        return None
    wait = due - transitions.now()
    if wait > HORIZON:
        return None
    return max(0.0, wait.total_seconds())
