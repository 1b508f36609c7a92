"""The admin's workers: create (the token is shown once), disable, re-enable,
rotate tokens."""

from __future__ import annotations

from weakref import WeakKeyDictionary

from django import forms
from django.contrib import admin, messages
from django.db import transaction
from django.db.models import Count, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

from batches.labels import format_pairs
from console.admin.support import (
    SAMPLE_SIZE,
    Confirmation,
    changelist_link,
    is_confirmed,
    link_to_id,
    log_changes,
    render_confirmation,
)
from jobs import transitions
from jobs.models import Job, Lease, Worker
from jobs.tokens import issue_worker_token

# The token of a worker just added, from save_model to response_add of the same
# request (never stored anywhere else).
_new_tokens: WeakKeyDictionary[HttpRequest, str] = WeakKeyDictionary()


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


class WorkerForm(forms.ModelForm):
    class Meta:
        model = Worker
        fields = ("name",)

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if not name or any(not c.isprintable() for c in name):
            raise forms.ValidationError("Use 1 to 100 printable characters.")
        return name


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    """Workers: create (the token is shown once), disable, re-enable, rotate.

    The token's hash and prefix are never editable, and whether a worker is
    active changes only through the actions (audited, with a confirmation).
    """

    list_display = (
        "name",
        "is_active",
        "token_prefix",
        "last_seen",
        "labels_column",
        "live_leases",
        "created_at",
        "ledger_column",
    )
    list_filter = ("is_active",)
    search_fields = ("name",)
    ordering = ("name",)
    form = WorkerForm
    actions = (
        "disable_workers",
        "disable_and_reclaim",
        "enable_workers",
        "rotate_tokens",
    )
    change_fields = (
        "name",
        "is_active",
        "token_prefix",
        "created_at",
        "last_seen",
        "labels_column",
        "live_leases",
        "ledger_column",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        live = (
            Job.objects.filter(leased_by=OuterRef("pk"))
            .order_by()
            .values("leased_by")
            .annotate(n=Count("pk"))
            .values("n")
        )
        return super().get_queryset(request).annotate(live=Coalesce(Subquery(live), 0))

    def get_fields(self, request: HttpRequest, obj=None) -> tuple[str, ...]:
        return ("name",) if obj is None else self.change_fields

    @admin.display(description="labels")
    def labels_column(self, worker: Worker) -> str:
        """The labels of the worker's latest claim (``-`` for none)."""
        labels = worker.labels if isinstance(worker.labels, dict) else {}
        return format_pairs(labels) or "-"

    def get_readonly_fields(self, request: HttpRequest, obj=None) -> tuple[str, ...]:
        return () if obj is None else self.change_fields[1:]

    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        # Bulk delete would list every protected ledger row of every worker.
        actions.pop("delete_selected", None)
        return actions

    def has_delete_permission(self, request, obj=None) -> bool:
        """Only a worker that never held a lease: the ledger keeps the others
        (disable them instead)."""
        return (
            obj is not None
            and super().has_delete_permission(request, obj)
            and not Lease.objects.filter(worker=obj).exists()
        )

    def has_disable_worker_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.disable_worker")

    def has_rotate_worker_token_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.rotate_worker_token")

    def has_disable_and_reclaim_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perms(["jobs.disable_worker", "jobs.force_reclaim"])

    # Creating a worker: the token is made here and shown once.

    def save_model(self, request, obj: Worker, form, change: bool) -> None:
        if not change:
            _new_tokens[request] = issue_worker_token(obj)
        super().save_model(request, obj, form, change)

    def response_add(
        self, request: HttpRequest, obj: Worker, post_url_continue=None
    ) -> HttpResponse:
        return self._token_page(
            request,
            title=f"Worker “{obj.name}” created",
            tokens=[(obj, _new_tokens.pop(request))],
        )

    # Columns.

    @admin.display(description="live leases", ordering="live")
    def live_leases(self, worker: Worker) -> str:
        count = getattr(worker, "live", None)
        if count is None:
            count = Job.objects.filter(leased_by=worker).count()
        if not count:
            return "0"
        return changelist_link(
            Job, str(count), leased_by__id__exact=worker.pk, status__exact="leased"
        )

    @admin.display(description="ledger")
    def ledger_column(self, worker: Worker) -> str:
        return changelist_link(Lease, "leases", worker__id__exact=worker.pk)

    # Actions.

    @admin.action(
        description="Disable selected workers", permissions=["disable_worker"]
    )
    def disable_workers(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        return self._set_active(request, queryset, active=False)

    @admin.action(
        description="Disable selected workers and reclaim their leases now",
        permissions=["disable_and_reclaim"],
    )
    def disable_and_reclaim(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        """Stop a stolen or broken worker at once: disabled, and every live
        lease it holds force-reclaimed, in one transaction per worker."""
        workers = list(queryset.order_by("name"))
        if not is_confirmed(request):
            leases = sum(getattr(w, "live", 0) for w in workers)
            return render_confirmation(
                self,
                request,
                Confirmation(
                    title="Disable workers and reclaim their leases",
                    summary="Disable the selected workers and end their live "
                    "leases now.",
                    counts=[
                        ("Workers selected: disabled", len(workers)),
                        ("Their live leases: force-reclaimed", leases),
                    ],
                    effects=[
                        "Every request they make gets 403 from now on.",
                        "Each job they hold goes back to queued with its item; the "
                        "attempt is not counted, and its lease-ledger row is closed "
                        "as “forced”.",
                        "If the worker comes back, its old lease tokens are refused "
                        "(409): it cannot touch those jobs again.",
                    ],
                    sample=[_describe_worker(w) for w in workers[:SAMPLE_SIZE]],
                    changing=len(workers),
                    button=f"Disable {_workers(len(workers))} and reclaim",
                ),
            )
        ended = 0
        for worker in workers:

            def audit(jobs, worker=worker) -> None:
                log_changes(
                    request,
                    [worker],
                    f"Disabled and reclaimed {len(jobs)} live lease(s): its requests "
                    f"get 403, its jobs are queued again.",
                )
                log_changes(
                    request,
                    jobs,
                    "Force reclaim: the worker was disabled; job queued again.",
                )

            ended += len(
                transitions.disable_and_reclaim(worker, actor=request.user, audit=audit)
            )
        self.message_user(
            request,
            f"Disabled {_workers(len(workers))}; {ended} live lease(s) reclaimed "
            f"and their jobs queued again.",
            messages.SUCCESS,
        )
        return None

    @admin.action(
        description="Re-enable selected workers", permissions=["disable_worker"]
    )
    def enable_workers(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        return self._set_active(request, queryset, active=True)

    @admin.action(
        description="Rotate the tokens of selected workers",
        permissions=["rotate_worker_token"],
    )
    def rotate_tokens(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        workers = list(queryset.order_by("name"))
        if not is_confirmed(request):
            return render_confirmation(
                self,
                request,
                Confirmation(
                    title="Rotate worker tokens",
                    summary="Give each selected worker a new token.",
                    counts=[("Workers selected: new tokens", len(workers))],
                    effects=[
                        "The old token stops working at once: every request with "
                        "it gets 401.",
                        "The new token is shown once, on the next page, and never "
                        "again: copy it into the worker's configuration.",
                        "A worker running now cannot heartbeat until it has the new "
                        "token; if that takes longer than its lease, the lease runs "
                        "out and the job is reclaimed.",
                    ],
                    sample=[_describe_worker(w) for w in workers[:SAMPLE_SIZE]],
                    changing=len(workers),
                    button=f"Rotate the tokens of {_workers(len(workers))}",
                ),
            )
        tokens = []
        for worker in workers:
            with transaction.atomic():
                token = transitions.rotate_worker_token(worker)
                log_changes(
                    request, [worker], "Rotated the token; the old one stopped working."
                )
            tokens.append((worker, token))
        return self._token_page(request, title="Tokens rotated", tokens=tokens)

    def _set_active(
        self, request: HttpRequest, queryset: QuerySet, *, active: bool
    ) -> HttpResponse | None:
        verb = "Re-enable" if active else "Disable"
        changing = list(queryset.filter(is_active=not active).order_by("name"))
        skipped = queryset.count() - len(changing)
        if not is_confirmed(request):
            effects = (
                ["Their requests are accepted again from now on."]
                if active
                else [
                    "Every request they make gets 403 from now on; they cannot "
                    "claim, heartbeat or complete.",
                    "A live lease they hold is not ended now: it runs out and the "
                    "job is reclaimed. To hand such a job out at once, force-"
                    "reclaim it from the job list (linked under “live leases”).",
                ]
            )
            return render_confirmation(
                self,
                request,
                Confirmation(
                    title=f"{verb} workers",
                    summary=f"{verb} the selected workers.",
                    counts=[
                        ("Workers selected", len(changing) + skipped),
                        (
                            "Re-enabled" if active else "Disabled",
                            len(changing),
                        ),
                        (
                            f"Skipped: already {'active' if active else 'disabled'}",
                            skipped,
                        ),
                    ],
                    effects=effects,
                    sample=[_describe_worker(w) for w in changing[:SAMPLE_SIZE]],
                    changing=len(changing),
                    button=f"{verb} {_workers(len(changing))}" if changing else None,
                ),
            )
        done = 0
        for worker in changing:
            with transaction.atomic():
                if transitions.set_worker_active(worker, active):
                    log_changes(
                        request,
                        [worker],
                        "Re-enabled." if active else "Disabled: its requests get 403.",
                    )
                    done += 1
        self.message_user(
            request,
            f"{'Re-enabled' if active else 'Disabled'} {_workers(done)}.",
            messages.SUCCESS,
        )
        if skipped:
            self.message_user(
                request,
                f"Skipped {_workers(skipped)}: already "
                f"{'active' if active else 'disabled'}.",
                messages.WARNING,
            )
        return None

    def _token_page(self, request: HttpRequest, *, title: str, tokens) -> HttpResponse:
        """Show new tokens, once: this response is the only place they appear
        (never in a message, the session, a log or a cache)."""
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "subtitle": None,
            "opts": self.opts,
            "tokens": tokens,
        }
        request.current_app = self.admin_site.name
        response = TemplateResponse(request, "admin/jobs/worker/token.html", context)
        add_never_cache_headers(response)
        return response


def _describe_worker(worker: Worker) -> str:
    live = getattr(worker, "live", 0)
    text = worker.name + (
        f" (holds {live} live lease{'s' * (live != 1)})" if live else ""
    )
    return link_to_id(Worker, worker.pk, text)
