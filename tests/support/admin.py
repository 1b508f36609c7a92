"""The admin's pages as its own forms drive them: the pages' paths, the
permissions a read-only admin holds, and actions posted as the list page and its
confirmation page post them."""

from __future__ import annotations

from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.test import Client

JOBS = "/admin/jobs/job/"


WORKERS = "/admin/jobs/worker/"


# Every model the admin shows, by app label: what a read-only admin is granted.
VIEW_ALL = (
    "jobs.view_job",
    "jobs.view_lease",
    "jobs.view_event",
    "jobs.view_worker",
    "batches.view_batch",
    "batches.view_batchitem",
    "admin.view_logentry",
)


def permission(name: str) -> Permission:
    app_label, codename = name.split(".")
    return Permission.objects.get(content_type__app_label=app_label, codename=codename)


def act(
    client: Client,
    action: str,
    ids,
    *,
    confirm: bool,
    url: str = JOBS,
    select_across: bool = False,
):
    """POST an action as the admin's list page does (``confirm=False``), or as
    its confirmation page does (``confirm=True``: ``post=yes``, no ``index``)."""
    data = {
        "action": action,
        ACTION_CHECKBOX_NAME: [str(i) for i in ids],
        "select_across": "1" if select_across else "0",
    }
    if confirm:
        data["post"] = "yes"
    else:
        data["index"] = "0"
    return client.post(url, data)


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]
