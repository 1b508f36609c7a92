"""The operator roles, as Django groups.

* Viewers: every operator page, read-only.
* Operators: also create batches, pause, resume, cancel, retry and export.
* Staff admins: superusers (or staff with admin permissions): everything, plus
  the admin site.

``ensure_groups`` creates or completes the groups; the migration that sets
them up and the tests both call it. ``viewer_required`` guards every operator
page (batches', workers', and any other app's).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.apps import apps as global_apps
from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse

VIEW = [
    ("batches", "view_batch"),
    ("batches", "view_batchitem"),
    ("jobs", "view_job"),
    ("jobs", "view_lease"),
    ("jobs", "view_worker"),
]
OPERATE = [
    ("batches", "add_batch"),
    ("batches", "operate_batch"),
    ("batches", "export_batch"),
]
GROUPS = {"Viewers": VIEW, "Operators": VIEW + OPERATE}


def ensure_groups(apps=global_apps) -> None:
    """Create the groups and give them their permissions (idempotent)."""
    from django.contrib.auth.management import create_permissions

    # Permissions are normally created after all migrations; make sure they exist.
    for app_config in apps.get_app_configs():
        models_module = getattr(app_config, "models_module", None)
        app_config.models_module = models_module or True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = models_module
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for name, codenames in GROUPS.items():
        group, _ = Group.objects.get_or_create(name=name)
        for app_label, codename in codenames:
            group.permissions.add(
                Permission.objects.get(
                    content_type__app_label=app_label, codename=codename
                )
            )


def viewer_required(
    view: Callable[..., HttpResponse],
) -> Callable[..., HttpResponse]:
    """Logged in (else to the login page) and allowed to view batches (else 403)."""

    @login_required
    @permission_required("batches.view_batch", raise_exception=True)
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return view(request, *args, **kwargs)

    return wrapper
