"""The Django admin for jobs, the lease ledger, workers and the event log.

Admins inspect and intervene here, and the admin never becomes a way to break
the invariants the transitions keep:

* Status, lease and attempt fields are read-only everywhere. Jobs, ledger rows
  and events cannot be added, edited or deleted through the admin at all.
* Every intervention is an action with a confirmation page, gated by its own
  permission, that calls a transition on the models (``JobQuerySet``'s
  ``force_reclaim``, ``retry_failed`` and ``cancel_queued``, or the sweep) over
  the selection's ids in chunks, so "all N matching" never holds locks for long.
* Every action is audited twice, in the transaction that makes the change: an
  ``Event`` per job (written by the model) and a Django admin ``LogEntry`` per
  row (written through the transitions' ``audit`` hook).

List pages stay cheap on tables of millions of rows: no COUNT(*) of a whole big
table (``EstimatedCountPaginator``), related rows fetched in the page's query,
filters that run no query or a tiny one, sorting only by id, search by id on
the primary key index.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.models import LogEntry
from django.db import transaction
from django.db.models import Count, F, Max, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html
from django.utils.text import Truncator

from batches.models import Batch, BatchItem

from .admin_support import (
    SAMPLE_SIZE,
    BatchFilter,
    BigTableAdmin,
    Confirmation,
    ReadOnlyInline,
    changelist_link,
    estimated_rows,
    id_chunks,
    id_search,
    is_confirmed,
    link_to_id,
    log_change_by_id,
    log_changes,
    render_confirmation,
    selects_across,
)
from .models import Event, Job, JobStatus, Lease, Worker
from .sweep import sweep

# Repairs listed by name on the reconciliation result page.
REPAIRS_SHOWN = 50
# A job action starts no new chunk after this many seconds, so one request stays
# well inside the server's timeout (gunicorn's is 60 s); the admin runs the
# action again for the rest. About 3,000 jobs a second go through on PostgreSQL.
ACTION_SECONDS = 20


def _jobs(n: int) -> str:
    return f"{n} job" if n == 1 else f"{n} jobs"


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


# --- Filters ------------------------------------------------------------------


class AttemptsFilter(admin.SimpleListFilter):
    """Attempts used: fixed choices, so rendering the filter runs no query (a
    list of the distinct values would scan the whole table)."""

    title = "attempts"
    parameter_name = "attempts"

    def lookups(self, request, model_admin) -> list[tuple[str, str]]:
        top = settings.RECALL_MAX_ATTEMPTS
        return [
            *((str(n), str(n)) for n in range(top)),
            (f"{top}+", f"{top} or more"),
            ("exhausted", "all used"),
        ]

    def queryset(self, request, queryset: QuerySet) -> QuerySet | None:
        value = self.value()
        if value is None:
            return None
        if value == "exhausted":
            return queryset.filter(attempts__gte=F("max_attempts"))
        if value.endswith("+") and value[:-1].isdigit():
            return queryset.filter(attempts__gte=int(value[:-1]))
        if value.isdigit():
            return queryset.filter(attempts=int(value))
        return queryset.none()


class WorkerFilter(admin.RelatedFieldListFilter):
    """The worker holding the job's live lease."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.title = "current worker"


class OpenLeaseFilter(admin.SimpleListFilter):
    title = "lease"
    parameter_name = "open"

    def lookups(self, request, model_admin) -> list[tuple[str, str]]:
        return [("yes", "live (not ended)"), ("no", "ended")]

    def queryset(self, request, queryset: QuerySet) -> QuerySet | None:
        if self.value() == "yes":
            return queryset.filter(ended_at__isnull=True)
        if self.value() == "no":
            return queryset.filter(ended_at__isnull=False)
        return None


# --- Inlines: a job's history on its page -------------------------------------


class LeaseInline(ReadOnlyInline):
    model = Lease
    verbose_name = "lease-ledger row"
    verbose_name_plural = "lease ledger (every attempt)"
    fields = (
        "attempt",
        "worker",
        "claimed_at",
        "heartbeat_at",
        "expires_at",
        "ended_at",
        "end_reason",
        "error",
    )
    readonly_fields = fields
    ordering = ("attempt", "pk")
    show_change_link = True

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).select_related("worker")


class EventInline(ReadOnlyInline):
    model = Event
    fk_name = "job"
    verbose_name_plural = "events (repairs and admin actions)"
    fields = ("created_at", "kind", "actor", "message")
    readonly_fields = fields
    ordering = ("pk",)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).select_related("actor")


# --- Jobs -----------------------------------------------------------------------


@dataclass(frozen=True)
class BulkAction:
    """One of the job actions that moves selected jobs through a transition."""

    # Which selected jobs it changes; the others are skipped.
    eligible: Q
    # The JobQuerySet transition: (actor=, now=, audit=) -> how many changed.
    transition: Callable[..., int]
    title: str
    summary: str
    changing: str  # the count label of the jobs that change
    skipped: str  # why the other selected jobs are left alone
    remaining: str  # what the jobs not reached yet still are ("leased")
    effects: tuple[str, ...]  # "{chunk}": the chunk size
    button: str  # "{n}": "3 jobs"
    done: str  # "{n}": "3 jobs"
    audit: str  # the admin log's change message for each job


IN_CHUNKS = (
    "Jobs are changed in chunks of {chunk}, each chunk in a short transaction of "
    "its own, so a large selection never holds many locks for long. After "
    "{seconds} seconds no new chunk is started: run the action again for the rest."
)

FORCE_RECLAIM = BulkAction(
    eligible=Q(status=JobStatus.LEASED),
    transition=lambda qs, **kw: qs.force_reclaim(**kw),
    title="Force reclaim leased jobs",
    summary="End the leases of the selected leased jobs now.",
    changing="Leased: force-reclaimed",
    skipped="not leased (any more)",
    remaining="leased",
    effects=(
        "Each job goes back to queued with its item, in a transaction of its own; "
        "the attempt is not counted.",
        "Its lease-ledger row is closed as “forced”.",
        "The worker that held it is fenced out: its next heartbeat, completion, "
        "failure or release for the job gets 409 and changes nothing.",
    ),
    button="Force reclaim {n}",
    done="Force-reclaimed {n}: queued again, their old workers fenced out.",
    audit="Force reclaim: lease ended (ledger row closed as forced), job queued "
    "again; the old worker is fenced out.",
)

REQUEUE_FAILED = BulkAction(
    eligible=Q(status=JobStatus.FAILED, batch__cancelled_at__isnull=True),
    transition=lambda qs, **kw: qs.retry_failed(**kw),
    title="Requeue failed jobs",
    summary="Queue the selected failed jobs again, with fresh attempts.",
    changing="Failed: queued again",
    skipped="not failed, or in a cancelled batch (retry leaves those failed)",
    remaining="failed",
    effects=(
        "Each job and its item go back to queued with fresh attempts (0 used); the "
        "lease ledger keeps the failed attempts.",
        "A batch marked finished is reopened so workers claim its jobs again.",
        IN_CHUNKS,
    ),
    button="Requeue {n}",
    done="Queued {n} again with fresh attempts.",
    audit="Requeue: queued again with fresh attempts.",
)

CANCEL_QUEUED = BulkAction(
    eligible=Q(status=JobStatus.QUEUED),
    transition=lambda qs, **kw: qs.cancel_queued(**kw),
    title="Cancel queued jobs",
    summary="Cancel the selected queued jobs.",
    changing="Queued: cancelled",
    skipped="not queued",
    remaining="queued",
    effects=(
        "Each job and its item become cancelled; workers will never claim them.",
        "A job a worker is claiming at this very moment is left alone (it is no "
        "longer queued).",
        IN_CHUNKS,
    ),
    button="Cancel {n}",
    done="Cancelled {n}.",
    audit="Cancel: job and item cancelled.",
)

REPORT_LABELS = {
    "items_healed": "Items brought in line with their job",
    "leases_closed": "Stray lease-ledger rows closed",
    "leases_restored": "Missing lease-ledger rows restored",
    "exhausted_failed": "Queued jobs with no attempts left, failed",
    "cancels_finished": "Jobs of interrupted batch cancels, cancelled",
    "batches_reopened": "Batches wrongly marked finished, reopened",
    "counters_fixed": "Batches whose progress counters were wrong, recounted",
}


@admin.register(Job)
class JobAdmin(BigTableAdmin):
    list_display = (
        "id",
        "status",
        "item_column",
        "batch_column",
        "attempts_column",
        "leased_by",
        "lease_expires_at",
        "updated_at",
        "ledger_column",
    )
    list_filter = (
        "status",
        BatchFilter,
        ("leased_by", WorkerFilter),
        AttemptsFilter,
        ("created_at", admin.DateFieldListFilter),
        ("finished_at", admin.DateFieldListFilter),
    )
    list_select_related = ("item", "batch", "leased_by")
    search_fields = ("item__source",)
    search_help_text = (
        "A job id, a whole lease token, or part of the item's source (case matters)."
    )
    actions = ("force_reclaim", "requeue_failed", "cancel_queued", "run_reconcile")
    inlines = (LeaseInline, EventInline)
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "status",
                    "item_column",
                    "batch_column",
                    "attempts",
                    "max_attempts",
                    "available_at",
                    "created_at",
                    "updated_at",
                    "finished_at",
                )
            },
        ),
        (
            "Live lease",
            {
                "fields": (
                    "leased_by",
                    "lease_token_prefix",
                    "lease_expires_at",
                    "heartbeat_at",
                )
            },
        ),
        ("Outcome", {"fields": ("last_error", "result_preview")}),
        ("History", {"fields": ("history_column",)}),
    )
    readonly_fields = tuple(
        name for _, options in fieldsets for name in options["fields"]
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # The change page shows the item, batch and worker: fetch them with it.
        return (
            super().get_queryset(request).select_related("item", "batch", "leased_by")
        )

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        """A number finds a job by id, a lease token its job (both on unique
        indexes); anything else is looked for in the items' sources. That is a
        scan of the items, so it is case-sensitive (LIKE, three times faster than
        ILIKE here) and only runs when no id or token matched."""
        term = search_term.strip()
        if not term:
            return queryset, False
        by_id = id_search(queryset, term)
        if by_id is not None:
            return by_id, False
        job_id = (
            Lease.objects.filter(token=term).values_list("job_id", flat=True).first()
        )
        if job_id is not None:
            return queryset.filter(pk=job_id), False
        return queryset.filter(item__source__contains=term), False

    # Columns and fields.

    @admin.display(description="item")
    def item_column(self, job: Job) -> str:
        return link_to_id(BatchItem, job.item_id, Truncator(job.item.source).chars(60))

    @admin.display(description="batch")
    def batch_column(self, job: Job) -> str:
        return link_to_id(Batch, job.batch_id, job.batch.name)

    @admin.display(description="attempts")
    def attempts_column(self, job: Job) -> str:
        return f"{job.attempts} of {job.max_attempts}"

    @admin.display(description="ledger")
    def ledger_column(self, job: Job) -> str:
        return changelist_link(Lease, "attempts", job__id__exact=job.pk)

    @admin.display(description="lease token")
    def lease_token_prefix(self, job: Job) -> str:
        # Enough to match a worker's log line; search takes the whole token.
        return f"{job.lease_token[:8]}…" if job.lease_token else "-"

    @admin.display(description="result")
    def result_preview(self, job: Job) -> str:
        if job.result is None:
            return "-"
        text = Truncator(str(job.result.get("text", ""))).chars(2000)
        segments = job.result.get("segments")
        if isinstance(segments, list):
            return f"{text}\n({len(segments)} timed segments)"
        return text

    @admin.display(description="history")
    def history_column(self, job: Job) -> str:
        history = reverse("admin:jobs_job_history", args=[job.pk])
        return format_html(
            "{} · {} · <a href='{}'>admin log</a>",
            changelist_link(Lease, "lease ledger", job__id__exact=job.pk),
            changelist_link(Event, "events", job__id__exact=job.pk),
            history,
        )

    # Permissions: one per action (declared on the Job model).

    def has_force_reclaim_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.force_reclaim")

    def has_requeue_job_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.requeue_job")

    def has_cancel_job_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.cancel_job")

    def has_run_reconcile_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.run_reconcile")

    # Actions.

    @admin.action(
        description="Force reclaim selected leased jobs", permissions=["force_reclaim"]
    )
    def force_reclaim(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        return self._bulk(request, queryset, FORCE_RECLAIM)

    @admin.action(
        description="Requeue selected failed jobs", permissions=["requeue_job"]
    )
    def requeue_failed(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        return self._bulk(request, queryset, REQUEUE_FAILED)

    @admin.action(description="Cancel selected queued jobs", permissions=["cancel_job"])
    def cancel_queued(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        return self._bulk(request, queryset, CANCEL_QUEUED)

    @admin.action(
        description="Run reconciliation now (whole database)",
        permissions=["run_reconcile"],
    )
    def run_reconcile(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        if not is_confirmed(request):
            return render_confirmation(self, request, self._reconcile_preview())
        before = Event.objects.aggregate(top=Max("pk"))["top"] or 0
        report = sweep()
        repairs = Event.objects.repairs().filter(pk__gt=before).order_by("pk")
        self._audit_reconcile(request, report, repairs)
        context = {
            **self.admin_site.each_context(request),
            "title": "Reconciliation report",
            "subtitle": None,
            "opts": self.opts,
            "reclaimed": report["reclaimed"],
            "healed": _healed_rows(report["reconcile"]),
            "skipped": report["reconcile"]
            if isinstance(report["reconcile"], str)
            else None,
            "jobs_scanned": _scanned(report["reconcile"]),
            "batches_finished": report.get("batches_finished", 0),
            "repairs": list(repairs.select_related("batch")[:REPAIRS_SHOWN]),
            "repair_count": repairs.count(),
            "repairs_url": reverse("admin:jobs_event_changelist")
            + f"?kind__exact=repair&id__gt={before}",
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/jobs/job/reconcile_result.html", context
        )

    def _bulk(
        self, request: HttpRequest, queryset: QuerySet, action: BulkAction
    ) -> HttpResponse | None:
        """Confirm, then run ``action`` over the selection's eligible jobs, one
        chunk of ids at a time, and report what changed, what was skipped, and
        what is left if the time limit stopped it."""
        if not is_confirmed(request):
            return render_confirmation(self, request, self._preview(queryset, action))
        now = timezone.now()
        deadline = time.monotonic() + ACTION_SECONDS
        # Ticked rows (not "all N matching") are at most a page: name the skipped.
        name_skipped = not selects_across(request)
        changed: list[int] = []

        def audit(jobs) -> None:
            log_changes(request, jobs, action.audit)
            if name_skipped:
                changed.extend(job.pk for job in jobs)

        done, left = 0, 0
        eligible = queryset.filter(action.eligible)
        for ids in id_chunks(eligible):
            done += action.transition(
                Job.objects.filter(pk__in=ids), actor=request.user, now=now, audit=audit
            )
            if time.monotonic() >= deadline:
                left = eligible.filter(pk__gt=ids[-1]).count()
                break
        if done:
            self.message_user(
                request, action.done.format(n=_jobs(done)), messages.SUCCESS
            )
        if left:
            self.message_user(
                request,
                f"Stopped after {ACTION_SECONDS} seconds to keep this request short; "
                f"still {action.remaining}: {_jobs(left)} of the selection. Run the "
                f"action again to go on.",
                messages.WARNING,
            )
        skipped = queryset.count() - done - left
        if skipped > 0:
            detail = ""
            if name_skipped and not left:
                rows = (
                    queryset.exclude(pk__in=changed)
                    .order_by("pk")
                    .values_list("pk", "status")
                )
                detail = ": " + ", ".join(f"job {pk} ({status})" for pk, status in rows)
            self.message_user(
                request,
                f"Skipped {_jobs(skipped)} of the selection: {action.skipped}{detail}.",
                messages.WARNING,
            )
        return None

    def _preview(self, queryset: QuerySet, action: BulkAction) -> Confirmation:
        counts = queryset.aggregate(
            selected=Count("pk"), eligible=Count("pk", filter=action.eligible)
        )
        selected, eligible = counts["selected"], counts["eligible"]
        sample = queryset.filter(action.eligible).order_by("pk")[:SAMPLE_SIZE]
        return Confirmation(
            title=action.title,
            summary=action.summary,
            counts=[
                ("Jobs selected", selected),
                (action.changing, eligible),
                (f"Skipped: {action.skipped}", selected - eligible),
            ],
            effects=[
                effect.format(chunk=settings.RECALL_CHUNK_SIZE, seconds=ACTION_SECONDS)
                for effect in action.effects
            ],
            sample=[_describe(job) for job in sample],
            changing=eligible,
            button=action.button.format(n=_jobs(eligible)) if eligible else None,
        )

    def _reconcile_preview(self) -> Confirmation:
        """Cheap counts only (index lookups, no scan): what a run will look at."""
        now = timezone.now()
        estimate = estimated_rows(Job.objects.all())
        total = Job.objects.count() if estimate is None else estimate
        budget = settings.RECALL_RECONCILE_SCAN_PER_SWEEP or total
        if budget >= total:
            scan = "The consistency scan checks every job against its item and batch."
        else:
            scan = (
                f"The consistency scan checks the next {budget} jobs against their "
                "items and batches; the scheduled sweep checks the rest in its next "
                "passes (`manage.py recall_sweep --full` checks every job at once)."
            )
        return Confirmation(
            title="Run reconciliation now",
            summary=(
                "Run one sweep over the whole database now, whichever jobs are "
                "selected."
            ),
            counts=[
                ("Expired leases, to be reclaimed", Job.objects.expired(now).count()),
                (
                    "Live leases, to be checked",
                    Job.objects.filter(status=JobStatus.LEASED).count(),
                ),
                # The scan goes by windows of ids: "about" this many.
                ("Jobs the consistency scan checks (about)", min(budget, total)),
                ("Jobs in all" + (" (estimated)" if estimate else ""), total),
                (
                    "Batches waiting for a recount",
                    Batch.objects.filter(recount_requested_at__isnull=False).count(),
                ),
                (
                    "Cancelled batches with unfinished jobs",
                    Batch.objects.filter(
                        cancelled_at__isnull=False, finished_at__isnull=True
                    ).count(),
                ),
            ],
            effects=[
                "Expired leases are reclaimed: the job is queued again, or failed "
                "on its last attempt.",
                "Every live lease, in-flight item and open lease-ledger row is "
                "checked against its job; interrupted batch cancels are finished.",
                scan,
                "Batches waiting for a recount are recounted; batches with nothing "
                "left to do are marked finished.",
                "Each repair is a short transaction of its own and is logged as an "
                "event on its job; the report lists them when the run ends.",
            ],
            button="Run reconciliation",
        )

    def _audit_reconcile(
        self, request: HttpRequest, report: dict, repairs: QuerySet
    ) -> None:
        """The admin log of a reconciliation run: one entry for the run, and one
        on each job or batch a repair touched (the repairs themselves are already
        events, written in their own transactions)."""
        reconciled = report["reconcile"]
        summary = (
            f"Ran reconciliation: reclaimed {report['reclaimed']['requeued']} "
            f"expired leases (queued) and {report['reclaimed']['failed']} (failed); "
            + (
                reconciled
                if isinstance(reconciled, str)
                else "healed "
                + ", ".join(f"{k} {v}" for k, v in reconciled.items())
                + f"; batches finished {report.get('batches_finished', 0)}"
            )
            + "."
        )
        log_change_by_id(request, [(Job, None, "reconciliation", summary)])
        for chunk in id_chunks(repairs):
            rows = Event.objects.filter(pk__in=chunk).values_list(
                "job_id", "batch_id", "message"
            )
            log_change_by_id(
                request,
                [
                    (
                        Job if job_id else Batch,
                        job_id or batch_id,
                        f"job {job_id}" if job_id else f"batch {batch_id}",
                        f"Repaired by a reconciliation run from the admin: {message}",
                    )
                    for job_id, batch_id, message in rows
                    if job_id or batch_id
                ],
            )


def _describe(job: Job) -> str:
    text = f"job {job.pk}: {Truncator(job.item.source).chars(80)}"
    if job.leased_by_id:
        text += f" (leased by {job.leased_by.name})"
    return link_to_id(Job, job.pk, text)


def _healed_rows(reconciled) -> list[tuple[str, int]]:
    if isinstance(reconciled, str):
        return []
    return [(label, reconciled[key]) for key, label in REPORT_LABELS.items()]


def _scanned(reconciled) -> int | None:
    return None if isinstance(reconciled, str) else reconciled["jobs_scanned"]


# --- The lease ledger -------------------------------------------------------------


@admin.register(Lease)
class LeaseAdmin(BigTableAdmin):
    list_display = (
        "id",
        "job_column",
        "worker",
        "attempt",
        "claimed_at",
        "heartbeat_at",
        "expires_at",
        "ended_at",
        "end_reason",
    )
    list_filter = (
        OpenLeaseFilter,
        "end_reason",
        "worker",
        ("claimed_at", admin.DateFieldListFilter),
    )
    list_select_related = ("worker",)
    search_fields = ("token",)
    search_help_text = "A job id, or a whole lease token."
    fields = (
        "job_column",
        "worker",
        "token_prefix",
        "attempt",
        "claimed_at",
        "heartbeat_at",
        "expires_at",
        "ended_at",
        "end_reason",
        "error",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).select_related("worker")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        by_job = id_search(queryset, term, "job_id")
        return (queryset.filter(token=term) if by_job is None else by_job), False

    @admin.display(description="job")
    def job_column(self, lease: Lease) -> str:
        return link_to_id(Job, lease.job_id, f"job {lease.job_id}")

    @admin.display(description="token")
    def token_prefix(self, lease: Lease) -> str:
        return f"{lease.token[:8]}…"


# --- Workers --------------------------------------------------------------------


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
        "live_leases",
        "created_at",
        "ledger_column",
    )
    list_filter = ("is_active",)
    search_fields = ("name",)
    ordering = ("name",)
    form = WorkerForm
    actions = ("disable_workers", "enable_workers", "rotate_tokens")
    change_fields = (
        "name",
        "is_active",
        "token_prefix",
        "created_at",
        "last_seen",
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

    # Creating a worker: the token is made here and shown once.

    def save_model(self, request, obj: Worker, form, change: bool) -> None:
        if not change:
            obj._new_token = obj.set_new_token()
        super().save_model(request, obj, form, change)

    def response_add(
        self, request: HttpRequest, obj: Worker, post_url_continue=None
    ) -> HttpResponse:
        return self._token_page(
            request,
            title=f"Worker “{obj.name}” created",
            tokens=[(obj, obj._new_token)],
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
                token = worker.rotate_token()
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
                if worker.set_active(active):
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


# --- The event log ------------------------------------------------------------------


@admin.register(Event)
class EventAdmin(BigTableAdmin):
    """Recall's own audit and repair log: read-only."""

    list_display = (
        "id",
        "created_at",
        "kind",
        "job_column",
        "batch_column",
        "actor",
        "message_column",
    )
    list_filter = (
        "kind",
        BatchFilter,
        ("created_at", admin.DateFieldListFilter),
    )
    list_select_related = ("actor",)
    search_fields = ("message",)
    search_help_text = "A job id, or part of the message."
    fields = ("created_at", "kind", "job_column", "batch_column", "actor", "message")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).select_related("actor")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        by_job = id_search(queryset, term, "job_id")
        if by_job is not None:
            return by_job, False
        return queryset.filter(message__icontains=term), False

    @admin.display(description="job")
    def job_column(self, event: Event) -> str:
        return link_to_id(Job, event.job_id, f"job {event.job_id}")

    @admin.display(description="batch")
    def batch_column(self, event: Event) -> str:
        return link_to_id(Batch, event.batch_id, f"batch {event.batch_id}")

    @admin.display(description="message")
    def message_column(self, event: Event) -> str:
        return Truncator(event.message).chars(120)


# --- Django's admin log -------------------------------------------------------------


@admin.register(LogEntry)
class LogEntryAdmin(BigTableAdmin):
    """Django's admin log, browsable: who did what, when, to which row."""

    list_display = (
        "action_time",
        "user",
        "content_type",
        "object_column",
        "action_flag",
        "message_column",
    )
    list_filter = (
        "action_flag",
        "content_type",
        ("action_time", admin.DateFieldListFilter),
    )
    list_select_related = ("user", "content_type")
    search_fields = ("object_repr", "change_message")
    sortable_by = ()
    fields = (
        "action_time",
        "user",
        "content_type",
        "object_column",
        "action_flag",
        "message_column",
    )
    readonly_fields = fields

    @admin.display(description="object")
    def object_column(self, entry: LogEntry) -> str:
        url = entry.get_admin_url()
        if url and not entry.is_deletion():
            return format_html('<a href="{}">{}</a>', url, entry.object_repr)
        return entry.object_repr

    @admin.display(description="change")
    def message_column(self, entry: LogEntry) -> str:
        return entry.get_change_message()
