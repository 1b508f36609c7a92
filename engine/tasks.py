"""django-q2 task entry points (thin: they call the same code as the commands).

Stored schedules and queued tasks name these by path (``engine.tasks.sweep``);
tasks queued before the move under ``jobs.tasks``, ``batches.tasks`` and
``operator_api.tasks`` still run: ``engine/apps.py`` keeps those paths as
aliases of this module.
"""

from __future__ import annotations

import logging

from django_q.tasks import async_task

from engine import background_intake
from engine.sweep import sweep as run_sweep
from engine.webhooks.delivery import DISPATCH_TASK, dispatch, seconds_until_due
from jobs import transitions
from operator_api.idempotency import forget_expired

log = logging.getLogger("recall.webhooks")


def sweep() -> dict:
    """The scheduled sweep (``recall-sweep`` schedule, every minute)."""
    return run_sweep()


def deliver_webhooks(delivery_ids: list[int]) -> dict:
    """First attempts, queued when their event commits; then the dispatcher's
    work while a retry falls due soon."""
    return dispatch(delivery_ids).as_dict()


def dispatch_webhooks(handover: str = "", standby: bool = False) -> dict:
    """The dispatcher: scheduled every minute (``recall-webhooks``), queued
    by the previous one as its successor (``handover``), or by a cluster
    starting (``standby``: it waits out a killed cluster's lease)."""
    return dispatch(handover=handover, standby=standby).as_dict()


def run_intake(intake_id: int) -> str:
    """A background intake (queued by the new-batch form for large manifests)."""
    return background_intake.run_intake(intake_id)


def forget_expired_keys() -> int:
    """The hourly ``recall-idempotency-keys`` schedule: expired keys go."""
    return forget_expired(now=transitions.now())


def cluster_worker_started(sender: object = None, **kwargs: object) -> None:
    """A cluster worker process started (the cluster starting, or a worker
    reincarnated after a crash; django-q2's ``post_spawn``): queue a
    dispatcher if an attempt falls due soon, so a delivery a killed cluster
    interrupted is made again within seconds of its lease running out, not at
    the next scheduled run (up to a minute and a half later). It stands by:
    the dispatcher's lease it finds held may be the killed cluster's, which
    nobody releases; it takes over when that runs out (within seconds of the
    kill, or of the attempts it was making). Several workers starting queue
    several: one takes the lease, the others see it taken and return. Never
    raises: a worker must start whatever the database says."""
    try:
        if seconds_until_due() is not None:
            async_task(DISPATCH_TASK, standby=True)
    except Exception:
        log.exception("could not queue the webhook dispatcher at start-up")
