"""Request metrics of the worker API, counted where the requests are served.

``recall_api_requests`` (by endpoint and status) and ``recall_claim_seconds``:
under gunicorn they are prometheus_client multiprocess metrics, merged into
``/metrics`` by ``recall_site/metrics.py``; a process serving alone (tests,
``runserver``) reports its own. ``observed`` wraps a worker API view;
``count_request`` counts one answer (a parked claim's, when it is sent).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial, wraps

from django.http import HttpRequest, HttpResponse
from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import Metric

from jobs.exceptions import DATABASE_DOWN

from .waiter import WAITER_KEY, Waiter

# --- Request metrics of the worker API ---------------------------------------------

# Server time of a claim: about a millisecond when idle, up to a few hundred
# under a sweep of thousands of expired leases (BENCHMARKS.md).
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass(frozen=True)
class RequestMetrics:
    requests: Counter
    claim_seconds: Histogram

    def collect(self) -> Iterator[Metric]:
        yield from self.requests.collect()
        yield from self.claim_seconds.collect()


# recall_api_requests_total's series exported at 0 before any request.
ANSWERED_FROM_THE_START = (
    ("claim", "200"),
    ("claim", "204"),
    ("heartbeat", "200"),
    ("heartbeat_many", "200"),
    ("complete", "200"),
    ("complete_many", "200"),
    ("fail", "200"),
    ("release", "200"),
)

_request_metrics: RequestMetrics | None = None
_request_metrics_lock = threading.Lock()


def request_metrics() -> RequestMetrics:
    """This process's request metrics, created on first use: in a gunicorn
    worker, not in the master, and never by merely importing this module (a
    multiprocess metric without labels opens its file when it is made)."""
    global _request_metrics
    with _request_metrics_lock:
        if _request_metrics is None:
            _request_metrics = RequestMetrics(
                requests=Counter(
                    "recall_api_requests",
                    "Worker API requests answered, by endpoint and HTTP status.",
                    ["endpoint", "status"],
                    registry=None,
                ),
                claim_seconds=Histogram(
                    "recall_claim_seconds",
                    "Server time of a claim request (authentication, claim, "
                    "response), empty queue included.",
                    buckets=CLAIM_BUCKETS,
                    registry=None,
                ),
            )
            # Every endpoint's usual answers exist at 0 from the start, so the
            # family (HELP, TYPE, series) is scraped before the first request,
            # in gunicorn's metric files too (which hold only what was made).
            for endpoint, status in ANSWERED_FROM_THE_START:
                _request_metrics.requests.labels(endpoint, status)
        return _request_metrics


def observed(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Count a worker API view's requests by endpoint (the view's name) and
    status, and time claims. A lost database counts as the 503 it becomes
    (DatabaseUnavailableMiddleware). A claim the view parked (long-poll) is not
    answered yet: the server counts it when it sends the kept 204
    (``Waiter.on_answer``), or ``claims_for_waiting`` when it sends a 200."""
    endpoint = view.__name__

    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        started = time.perf_counter()
        status = 500
        try:
            response = view(request, *args, **kwargs)
            status = response.status_code
            return response
        except DATABASE_DOWN:
            status = 503
            raise
        finally:
            count = partial(
                count_request, endpoint, status, time.perf_counter() - started
            )
            waiter = request.META.get(WAITER_KEY)
            if isinstance(waiter, Waiter) and waiter.parked:
                waiter.on_answer = count
            else:
                count()

    return wrapper


def count_request(endpoint: str, status: int, seconds: float) -> None:
    """Count one answered worker API request (and time it, if a claim)."""
    metrics = request_metrics()
    _requests_counter(metrics, endpoint, status).inc()
    if endpoint == "claim":
        metrics.claim_seconds.observe(seconds)


@functools.cache
def _requests_counter(metrics: RequestMetrics, endpoint: str, status: int) -> Counter:
    """``recall_api_requests`` of one endpoint and status, looked up once:
    ``labels()`` checks and joins the labels and takes a lock on every call.
    A handful of endpoints and statuses: the cache stays small."""
    return metrics.requests.labels(endpoint, str(status))
