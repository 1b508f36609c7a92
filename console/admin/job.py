"""The admin's job list and job page, with the bulk actions and reconciliation."""

from __future__ import annotations

import time

from django.conf import settings
from django.contrib import admin, messages
from django.db.models import Count, F, Max, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.text import Truncator

from batches.models import Batch, BatchItem
from batches.numbers import whole_number
from console.admin.job_actions import (
    ACTION_SECONDS,
    CANCEL_QUEUED,
    FORCE_RECLAIM,
    REPAIRS_SHOWN,
    REPORT_LABELS,
    REQUEUE_FAILED,
    BulkAction,
    jobs_text,
)
from console.admin.support import (
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
    or_transcript,
    render_confirmation,
    selects_across,
)
from engine.sweep import sweep
from jobs import transitions
from jobs.models import Event, Job, JobRun, JobStatus, Lease
from jobs.search import jobs_with_transcript

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
        if value.endswith("+") and (least := whole_number(value[:-1])) is not None:
            return queryset.filter(attempts__gte=least)
        if (exactly := whole_number(value)) is not None:
            return queryset.filter(attempts=exactly)
        return queryset.none()


class WorkerFilter(admin.RelatedFieldListFilter):
    """The worker holding the job's live lease."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.title = "current worker"


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


class RunInline(ReadOnlyInline):
    """Earlier runs of the job (a re-run keeps each one)."""

    model = JobRun
    verbose_name = "earlier run"
    verbose_name_plural = "earlier runs (kept by re-runs)"
    fields = (
        "number",
        "status",
        "attempts",
        "worker",
        "finished_at",
        "flags",
        "requires",
        "rerun_at",
        "rerun_by",
        "error",
    )
    readonly_fields = fields
    ordering = ("number",)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).select_related("worker", "rerun_by")


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
        "A job id, a whole lease token, part of the item's source (case matters), "
        "or words of its transcript."
    )
    actions = ("force_reclaim", "requeue_failed", "cancel_queued", "run_reconcile")
    inlines = (RunInline, LeaseInline, EventInline)
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "status",
                    "item_column",
                    "batch_column",
                    "run",
                    "requires",
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
        str(name) for _, options in fieldsets for name in options["fields"]
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
        indexes); anything else is looked for in the items' sources and in the
        completed jobs' transcripts. The sources' match is a scan of the items,
        so it is case-sensitive (LIKE, three times faster than ILIKE here) and
        only runs when no id or token matched; the transcripts' is the batch
        page's and /search/'s (``jobs.search``: the full-text index on
        PostgreSQL, substrings on SQLite)."""
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
        by_source = queryset.filter(item__source__contains=term)
        return or_transcript(queryset, by_source, term, jobs_with_transcript), False

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
        # Any JSON value: rows stored before the API checked results closely.
        result = job.result if isinstance(job.result, dict) else {}
        text = Truncator(str(result.get("text", ""))).chars(2000)
        segments = result.get("segments")
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
        now = transitions.now()
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
                request, action.done.format(n=jobs_text(done)), messages.SUCCESS
            )
        if left:
            self.message_user(
                request,
                f"Stopped after {ACTION_SECONDS} seconds to keep this request short; "
                f"still {action.remaining}: {jobs_text(left)} of the selection. Run "
                f"the action again to go on.",
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
                f"Skipped {jobs_text(skipped)} of the selection: "
                f"{action.skipped}{detail}.",
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
            button=action.button.format(n=jobs_text(eligible)) if eligible else None,
        )

    def _reconcile_preview(self) -> Confirmation:
        """Cheap counts only (index lookups, no scan): what a run will look at."""
        now = transitions.now()
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
    if job.leased_by is not None:
        text += f" (leased by {job.leased_by.name})"
    return link_to_id(Job, job.pk, text)


def _healed_rows(reconciled) -> list[tuple[str, int]]:
    if isinstance(reconciled, str):
        return []
    return [(label, reconciled[key]) for key, label in REPORT_LABELS.items()]


def _scanned(reconciled) -> int | None:
    return None if isinstance(reconciled, str) else reconciled["jobs_scanned"]
