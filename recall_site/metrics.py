"""``GET /metrics``: Recall in the Prometheus text format.

Two kinds of figures, served together:

* **What lives in the database** (jobs per status, batches per state, the
  oldest claimable job, workers, the sweeper's age) is read by
  ``DatabaseCollector`` at scrape time, from a registry of its own that is not
  multiprocess: every process of every web node answers the same.
* **Per-process request metrics** of the worker API (``recall_api_requests``,
  ``recall_claim_seconds``) are counted where the requests are served
  (``api/request_metrics.py``). Under gunicorn they are prometheus_client
  multiprocess metrics, merged from every worker's files into the same
  response (``metric_files.py``); a process serving alone (tests,
  ``runserver``) reports its own.

Off (404) unless ``RECALL_METRICS_TOKEN`` is set; then the scraper must send
``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from functools import cached_property

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector

from api.request_metrics import request_metrics
from engine import fleet
from engine.progress import BatchState
from jobs import transitions
from jobs.models import JobStatus, RepairKind
from recall_site import metric_files

# --- Figures from the database ------------------------------------------------------
#
# One function per metric family: it gets the scrape (its ``now``, the
# database's clock, and the reads several families share, made once) and
# returns the family. ``@family`` adds it to the scrape.
#
# The monotonic counters (recall_*_total) come from the transition layer's
# tallies (``jobs.models.Tally``), written by the transitions in their own
# transactions: they survive restarts and every process reads the same. A
# counter family is named without "_total"; prometheus_client adds it.


class Scrape:
    """One scrape's view of the database: one ``now``, and each shared read
    made at most once."""

    def __init__(self, now: datetime):
        self.now = now

    @cached_property
    def job_counts(self) -> dict[str, int]:
        return fleet.job_counts()

    @cached_property
    def tallies(self) -> dict[str, int]:
        return fleet.tallies()

    @cached_property
    def finished_totals(self) -> tuple[int, int]:
        return fleet.finished_totals(self.job_counts, self.tallies)


Family = Callable[[Scrape], Metric]
FAMILIES: list[Family] = []


def family(function: Family) -> Family:
    FAMILIES.append(function)
    return function


@family
def jobs(scrape: Scrape) -> Metric:
    gauge = GaugeMetricFamily(
        "recall_jobs", "Jobs per status, right now.", labels=["status"]
    )
    counts = scrape.job_counts
    for status in JobStatus.values:
        gauge.add_metric([status], counts[status])
    return gauge


@family
def batches(scrape: Scrape) -> Metric:
    gauge = GaugeMetricFamily(
        "recall_batches",
        "Batches per state, as the operator UI shows them.",
        labels=["state"],
    )
    counts = fleet.batch_states(scrape.now)
    for state in BatchState.ALL:
        gauge.add_metric([state], counts[state])
    return gauge


@family
def batches_waiting_for_worker(scrape: Scrape) -> Metric:
    return GaugeMetricFamily(
        "recall_batches_waiting_for_worker",
        "Open batches with queued items that no worker seen recently can take "
        "(none offers the labels they require); 0 if none.",
        value=fleet.waiting_for_worker(scrape.now),
    )


@family
def oldest_queued(scrape: Scrape) -> Metric:
    return GaugeMetricFamily(
        "recall_oldest_queued_seconds",
        "Age of the oldest claimable job (queued, due, in an open batch); 0 if none.",
        value=fleet.oldest_queued_age(scrape.now),
    )


@family
def workers(scrape: Scrape) -> Metric:
    gauge = GaugeMetricFamily(
        "recall_workers",
        "Workers per state: busy (holds a live lease), idle (active, seen "
        "recently, no lease), offline (the rest).",
        labels=["state"],
    )
    counts = fleet.worker_states(scrape.now)
    for state in fleet.WorkerState.ALL:
        gauge.add_metric([state], counts[state])
    return gauge


@family
def last_sweep_age(scrape: Scrape) -> Metric:
    age = fleet.last_sweep_age(scrape.now)
    return GaugeMetricFamily(
        "recall_last_sweep_age_seconds",
        "Seconds since the last sweep finished; +Inf before the first one.",
        value=float("inf") if age is None else age,
    )


@family
def leases_expired(scrape: Scrape) -> Metric:
    return CounterMetricFamily(
        "recall_leases_expired",
        "Expired leases reclaimed, by a sweep or a claim.",
        value=scrape.tallies.get("leases_expired", 0),
    )


@family
def leases_forced(scrape: Scrape) -> Metric:
    return CounterMetricFamily(
        "recall_leases_forced",
        "Leases ended by force: an admin's force reclaim, a worker disabled and "
        "reclaimed, or a batch cancelled under them.",
        value=scrape.tallies.get("leases_forced", 0),
    )


@family
def jobs_completed(scrape: Scrape) -> Metric:
    completed, _ = scrape.finished_totals
    return CounterMetricFamily(
        "recall_jobs_completed", "Jobs completed, ever.", value=completed
    )


@family
def jobs_failed(scrape: Scrape) -> Metric:
    _, failed = scrape.finished_totals
    return CounterMetricFamily(
        "recall_jobs_failed",
        "Jobs failed for good (out of attempts, or a non-retryable error), ever; "
        "a retry does not take one back.",
        value=failed,
    )


@family
def reconcile_repairs(scrape: Scrape) -> Metric:
    counter = CounterMetricFamily(
        "recall_reconcile_repairs",
        "Repairs reconciliation (or a transition healing drifted rows) made, by kind.",
        labels=["kind"],
    )
    for kind in RepairKind:  # every kind, at 0 before its first repair
        counter.add_metric([kind.value], scrape.tallies.get(kind.tally, 0))
    return counter


class DatabaseCollector:
    """Every ``FAMILIES`` function, against one ``now`` per scrape."""

    def __init__(self, now: datetime | None = None):
        self.now = now

    def collect(self) -> Iterator[Metric]:
        scrape = Scrape(self.now or transitions.now())
        for function in FAMILIES:
            yield function(scrape)

    def describe(self) -> Iterable[Metric]:
        return ()  # registering must not query the database


# --- Exposition -------------------------------------------------------------------


def render(now: datetime | None = None) -> bytes:
    """The whole scrape: database figures and request metrics, merged."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(now))
    path = metric_files.directory()
    request_metrics()  # this process's families exist even before a request
    if path is None:
        registry.register(request_metrics())
        return generate_latest(registry)
    MultiProcessCollector(registry, path=path)
    with metric_files.reading(path):
        return generate_latest(registry)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics`` for a scraper holding ``RECALL_METRICS_TOKEN``.

    Answered before host validation and the HTTPS redirect, like the health
    probes: Prometheus scrapes each node by its address (request metrics are
    per node). Without a token configured it is not here at all (the caller
    passes the request on, and it ends as a 404).
    """
    if request.method != "GET":
        response = HttpResponse("Use GET.\n", status=405, content_type="text/plain")
        response["Allow"] = "GET"
        return response
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    expected = settings.RECALL_METRICS_TOKEN.encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode("utf-8", "surrogatepass"), expected
    ):
        response = HttpResponse(
            "Send the metrics token as 'Authorization: Bearer <token>'.\n",
            status=401,
            content_type="text/plain",
        )
        response["WWW-Authenticate"] = 'Bearer realm="recall-metrics"'
        return response
    try:
        body = render()
    except DatabaseError:
        # The request metrics alone would read as a healthy, empty system.
        response = HttpResponse(
            "The database is unavailable.\n", status=503, content_type="text/plain"
        )
        response["Retry-After"] = "5"
        return response
    response = HttpResponse(body, content_type=CONTENT_TYPE_PLAIN_0_0_4)
    response["Cache-Control"] = "no-store"
    return response
