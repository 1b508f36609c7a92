"""django-q2 tasks after the policies moved to ``engine/`` (issue 25).

Stored schedules name the new paths (migrations; tests/test_commands.py checks
them), and a task queued under an old path by the previous release still runs:
``engine/apps.py`` keeps ``jobs.tasks``, ``batches.tasks`` and
``operator_api.tasks`` as aliases of ``engine.tasks``.
"""

from __future__ import annotations

import multiprocessing
import pydoc
import queue

import pytest
from django_q.models import OrmQ, Schedule
from django_q.signing import SignedPackage
from django_q.tasks import async_task
from django_q.worker import worker

from engine import tasks
from engine.apps import OLD_TASK_MODULES

OLD_PATHS = [
    "jobs.tasks.sweep",
    "jobs.tasks.deliver_webhooks",
    "jobs.tasks.dispatch_webhooks",
    "batches.tasks.run_intake",
    "operator_api.tasks.forget_expired_keys",
]


@pytest.mark.parametrize("path", OLD_PATHS)
def test_an_old_task_path_finds_the_engine_function(path):
    # django-q2's worker finds a task's function with pydoc.locate.
    assert pydoc.locate(path) is getattr(tasks, path.rpartition(".")[2])


def test_every_old_task_module_is_an_alias():
    assert OLD_TASK_MODULES == ("jobs.tasks", "batches.tasks", "operator_api.tasks")
    for old in OLD_TASK_MODULES:
        assert pydoc.locate(old) is tasks


# transaction=True: the worker closes the connection before a task, as in a
# cluster, and the test's own transaction would not survive that.
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("module", OLD_TASK_MODULES)
def test_a_task_queued_under_an_old_path_runs(module):
    async_task(f"{module}.forget_expired_keys")
    (queued,) = OrmQ.objects.all()
    task = SignedPackage.loads(queued.payload)
    assert task["func"] == f"{module}.forget_expired_keys"

    # What a cluster's worker process does with it.
    inbox: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    inbox.put(task)
    inbox.put("STOP")
    worker(inbox, done, multiprocessing.Value("f", -1))

    finished = done.get_nowait()
    assert (finished["success"], finished["result"]) == (True, 0)


@pytest.mark.django_db
def test_no_stored_schedule_names_an_old_path():
    funcs = sorted(Schedule.objects.values_list("func", flat=True))
    assert funcs == [
        "engine.tasks.dispatch_webhooks",
        "engine.tasks.forget_expired_keys",
        "engine.tasks.sweep",
    ]
