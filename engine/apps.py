"""The engine app: Recall's policies, no models.

``ready`` keeps the task modules' old paths working: django-q2 finds a task's
function by its dotted path (``pydoc.locate``), and tasks queued before the
policies moved here name ``jobs.tasks``, ``batches.tasks`` or
``operator_api.tasks``. Each of those paths is made an alias of
``engine.tasks`` (in ``sys.modules`` and as the package's attribute, which is
what ``pydoc.locate`` walks), so such a task still runs. Stored schedules are
moved to the new paths by migrations (jobs 0015, operator_api 0004).
``ready`` also connects django-q2's ``post_spawn`` to
``engine.tasks.cluster_worker_started``: a cluster starting resumes the
webhook deliveries a killed one left.
"""

from __future__ import annotations

import importlib
import sys

from django.apps import AppConfig

# Old task module paths, by the package that held them.
OLD_TASK_MODULES = ("jobs.tasks", "batches.tasks", "operator_api.tasks")


def install_task_aliases() -> None:
    """Make every old task module path name ``engine.tasks``."""
    tasks = importlib.import_module("engine.tasks")
    for old in OLD_TASK_MODULES:
        package, _, name = old.rpartition(".")
        sys.modules[old] = tasks
        setattr(importlib.import_module(package), name, tasks)


class EngineConfig(AppConfig):
    name = "engine"
    verbose_name = "Engine"

    def ready(self) -> None:
        from django_q.signals import post_spawn

        from engine.tasks import cluster_worker_started

        install_task_aliases()
        # A cluster starting resumes the webhook deliveries a killed one left.
        post_spawn.connect(cluster_worker_started, dispatch_uid="recall-dispatch")
