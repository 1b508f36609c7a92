"""Long-poll claims: the hand-over between the claim view and the server.

A claim may ask to wait (``{"wait_seconds": N}``) when nothing is claimable.
The server, not the view, does the waiting: the claim view tries once and, if
the server offered a ``Waiter`` (``request.META[WAITER_KEY]``, set by the
gthread worker in ``recall_site/gunicorn_worker.py``), hands the request back
to it with ``Waiter.park``. The server then holds the connection in its event
loop (no thread, no database connection) and, when its probe
(``engine.longpoll.claimable_jobs``, one per interval for the whole server) says
a job may be claimable, claims for it with ``api.worker_views.claims_for_waiting``;
or it answers the 204 it kept when the wait is over. A server without
a waiter (``runserver``, the sync worker, the test client) answers at once, as
before. A parked claim keeps its parsed parameters (``ClaimRequest``), never
its body: a claim may carry megabytes it does not need, and a thousand of them
waiting held gigabytes. No Django imports: gunicorn's master loads this with
the worker class.

A worker may have at most ``RECALL_MAX_WAITING_CLAIMS_PER_WORKER`` claims
waiting on the whole server (``api/worker_limits.py``): ``park`` counts a
claim against its worker when it first parks, and the server calls ``done``
once it is answered or its client is gone, so each waiting claim counts once,
from the moment it parks to its answer (a woken claim parked again, or run
again through the view, is still the same claim).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from api import worker_limits
from batches.labels import satisfies

WAITER_KEY = "recall.waiter"
MAX_WAIT_SECONDS = 60
# A wait with less than this left is over: answering beats parking for a blink.
MIN_PARK_SECONDS = 0.05


# What the server is handed for a woken claim that found nothing it can take
# (``api.worker_views.claims_for_waiting``): it waits on.
KEEP_WAITING = b""


@dataclass(frozen=True)
class ClaimRequest:
    """What a parked claim keeps of its request: the claim's parameters, parsed
    and validated by the view (a few numbers and the worker's labels: add a
    field here for each new claim parameter). When the view must answer a
    woken claim itself (its worker was refused meanwhile), the server runs it
    again on ``body()``."""

    wait_seconds: float
    # The labels the claim declared (cleaned: at most 16 short pairs).
    labels: Mapping[str, str] = field(default_factory=dict)
    # None: a single claim (``{"job": ...}``); else up to this many jobs.
    max_jobs: int | None = None

    def body(self) -> bytes:
        """The JSON body the view parses back into these parameters."""
        body: dict[str, Any] = {"wait_seconds": self.wait_seconds}
        if self.labels:
            body["labels"] = dict(self.labels)
        if self.max_jobs is not None:
            body["max_jobs"] = self.max_jobs
        return json.dumps(body).encode()

    def serves(self, requires: Iterable[Mapping[str, str]] | None) -> bool:
        """Whether this claim's labels satisfy at least one of ``requires``
        (the requirements of the batches a probe found work in; None: the
        probe could not say, so any claim may find work)."""
        if requires is None:
            return True
        return any(satisfies(self.labels, each) for each in requires)


class Waiter:
    """One claim request the server can hold without a thread.

    The server makes one per request and offers it to the view in the WSGI
    environ; the view parks it (``park``) when nothing is claimable and the
    request asked to wait. The server reads ``parked`` after the view returns.
    """

    def __init__(self, started: float | None = None, *, quiet: bool = False) -> None:
        self.started = time.monotonic() if started is None else started
        # The server's probe found nothing claimable less than a probe interval
        # ago: a claim that may wait is parked without trying, and the next
        # probe wakes it if work has come since (an idle fleet's polls then
        # cost no claim statement).
        self.quiet = quiet
        self.deadline: float | None = None
        self.parked = False
        self.claim: ClaimRequest | None = None
        # The server's own state for this request (its parsed request, the
        # response kept for the deadline); the view never reads it.
        self.held: Any = None
        # Set by the view's request metrics when it parks: the server calls it
        # once it has sent the kept answer, so a claim that waited counts once,
        # with the status its client got (a woken claim's 200 counts itself).
        self.on_answer: Callable[[], None] | None = None
        # The worker whose waiting claims this one counts against, while it does.
        self.counted: int | None = None

    def park(
        self,
        wait_seconds: float,
        claim: ClaimRequest,
        *,
        worker: int | None = None,
        limit: int = 0,
    ) -> bool:
        """Hold this request until a job may be claimable or ``wait_seconds``
        (counted from the request's arrival) have passed, keeping ``claim``;
        False when the wait is already over, or ``worker`` has ``limit`` claims
        waiting already, and the view should answer now. Counted against
        ``worker`` from here until ``done``."""
        if wait_seconds <= 0:
            return False
        if self.deadline is None:
            self.deadline = self.started + wait_seconds
        if self.deadline - time.monotonic() < MIN_PARK_SECONDS:
            return False
        if self.counted is None and worker is not None:
            if not worker_limits.hold_waiting(worker, limit):
                return False
            self.counted = worker
        self.claim, self.parked = claim, True
        return True

    def done(self) -> None:
        """This claim waits no more (answered, or its client is gone): it no
        longer counts against its worker. Safe to call more than once."""
        counted, self.counted = self.counted, None
        if counted is not None:
            worker_limits.release_waiting(counted)
