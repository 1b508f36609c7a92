"""Batches waiting for a worker: claimable work that no worker online can take.

A batch with queued items that is open (not paused or cancelled) is **waiting
for a worker** when no active worker seen within ``seen_recently()`` (the
window the workers page and the overview call "online") declared labels that
satisfy what the batch requires (``batches.labels.satisfies``). A batch that
requires nothing is satisfied by any such worker, so with no worker online it
waits too. Its ETA is unknown: nothing says when a worker that can take it
will come.

It judges the batch's own requirement only. A re-run's requirement
(``Job.requires``, on some of a batch's jobs) is not judged here: a batch whose
only queued jobs are re-runs needing labels no worker online offers shows as
running, not waiting (the item page says what each re-run requires). Judging
it would mean reading the distinct requirements of every queued job on every
page, which the per-batch counters cannot say.

Cheap by construction: one query reads the distinct label sets of the workers
seen recently (a few rows, whatever the fleet's size), and each distinct
requirement set is judged once (``Offers`` remembers it), never per item.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from django.conf import settings

from batches.labels import Labels, missing, satisfies
from jobs.models import Worker


def seen_recently() -> timedelta:
    """How recently an idle worker must have called the API.

    A working worker heartbeats every third of a lease, and the reference
    worker polls an empty queue at least every 30 s (``--poll-max``); a worker
    that was silent for a whole lease would have lost any lease it held.
    ``last_seen`` is written at most every ``Worker.LAST_SEEN_RESOLUTION``
    (60 s), so that much slack is added: 120 s with the default 60 s leases.
    """
    return timedelta(seconds=settings.RECALL_LEASE_SECONDS) + (
        Worker.LAST_SEEN_RESOLUTION
    )


def offered_labels(now: datetime) -> list[Labels]:
    """The distinct label sets of the active workers seen within
    ``seen_recently()`` of ``now`` (each claim or poll updates ``last_seen``;
    a claim records the worker's labels): one query."""
    rows = (
        Worker.objects.filter(is_active=True, last_seen__gte=now - seen_recently())
        .values_list("labels", flat=True)
        .distinct()
        .order_by()
    )
    return [dict(labels) for labels in rows if isinstance(labels, Mapping)]


def unoffered(requires: Mapping[str, str], offered: list[Labels]) -> Labels | None:
    """None when some offered label set satisfies ``requires``; otherwise what
    the pages name: the required pairs that no worker offers, or all of them
    when each is offered by someone but no worker offers them together.
    ``{}`` for a batch that requires nothing and no worker online."""
    if any(satisfies(labels, requires) for labels in offered):
        return None
    nobody = dict(requires)
    for labels in offered:
        nobody = missing(labels, nobody)
    return nobody or dict(requires)


class Offers:
    """What the workers online offer, read once (on first use) at ``now``;
    each distinct requirement set is judged once."""

    def __init__(self, now: datetime, offered: list[Labels] | None = None):
        self.now = now
        self._offered = offered
        self._judged: dict[tuple[tuple[str, str], ...], Labels | None] = {}

    @property
    def offered(self) -> list[Labels]:
        if self._offered is None:
            self._offered = offered_labels(self.now)
        return self._offered

    def waiting_for(self, requires: Mapping[str, str]) -> Labels | None:
        """None if a worker online can take a batch requiring ``requires``;
        else the labels nobody offers (``unoffered``)."""
        key = tuple(sorted(requires.items()))
        if key not in self._judged:
            self._judged[key] = unoffered(requires, self.offered)
        return self._judged[key]
