"""The Django admin for batches and their items.

Batches are created by intake (``manage.py create_batch`` or the operator UI),
which also creates their jobs and progress counters together; a batch made
here would have neither, so the admin cannot add one. Nor can it delete one:
the delete page would list every item and job of a million-item batch, and
deleting under live leases would leave workers with jobs that vanished (cancel
the batch instead). Only a batch's name, its share of the workers (priority,
weight, max in flight) and, while it is open, the worker labels it requires are
editable, the share and the requirements through their transitions.

Progress is the operator UI's: the same state, bar, counts, throughput and ETA
(``engine.progress``, the same template fragments), refreshed in place by the
same script (static/js/recall.js) with the same control, in the admin's colours.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import PAGE_VAR, ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.template.loader import render_to_string
from django.urls import path
from django.utils.html import format_html
from django.utils.text import Truncator

from batches.flags import FLAG_COLUMNS
from batches.models import Batch, BatchItem, ItemStatus
from console.admin.support import (
    BatchFilter,
    BigTableAdmin,
    changelist_link,
    id_search,
    link_to_id,
    log_change_by_id,
    or_transcript,
)
from console.forms import RequiresField
from console.live import fragment
from engine.progress import (
    BatchState,
    Progress,
    in_state,
    progress_for,
    progress_for_many,
)
from jobs import transitions
from jobs.exceptions import BatchClosed, RerunRefused
from jobs.models import Event, Job
from jobs.search import with_transcript


class StateFilter(admin.SimpleListFilter):
    """The operator UI's states, decided by the same rules (``in_state``)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin) -> list[tuple[str, str]]:
        return [(s, s) for s in BatchState.ALL]

    def queryset(self, request, queryset: QuerySet) -> QuerySet | None:
        value = self.value()
        if value is None:
            return None
        if value not in BatchState.ALL:
            return queryset.none()
        return in_state(queryset, value, now=transitions.now())


class ProgressChangeList(ChangeList):
    """A page of batches, each with its ``progress`` (a few queries for the
    whole page), and what the live region needs to fetch the page again."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        self.result_list = list(self.result_list)
        progress = progress_for_many(self.result_list, now=transitions.now())
        for batch in self.result_list:
            batch.progress = progress[batch.pk]
        self.final = all(p.is_final for p in progress.values())
        self.live_query = self.get_query_string({PAGE_VAR: self.page_num})


class BatchForm(forms.ModelForm):
    """A weight left empty keeps the batch's weight; the requirements are typed
    as ``key=value`` pairs, as on the batch page."""

    class Meta:
        model = Batch
        fields = ("name", "priority", "weight", "max_in_flight", "requires")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["weight"].required = False

    def clean_weight(self) -> int:
        weight = self.cleaned_data.get("weight")
        return self.instance.weight if weight is None else weight


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    form = BatchForm
    # The bar, done, throughput and ETA next to the name, so that at 1400 px
    # they are on screen beside the filters; the share settings come after.
    list_display = (
        "id",
        "name",
        "state",
        "progress_column",
        "done_percent",
        "throughput",
        "eta",
        "priority",
        "weight",
        "max_in_flight",
        "created_at",
        "jobs_column",
    )
    list_display_links = ("id", "name")
    list_filter = (StateFilter,)
    date_hierarchy = "created_at"  # batches are few: cheap, unlike jobs
    search_fields = ("name",)
    search_help_text = "A batch id, or part of its name."
    ordering = ("-pk",)
    fieldsets = (
        (
            None,
            {"fields": ("name", "priority", "weight", "max_in_flight", "requires")},
        ),
        ("Progress", {"fields": ("live_progress",)}),
        (
            "Details",
            {
                "fields": (
                    "total",
                    "created_at",
                    "created_by",
                    "total_ms",
                    "durations_known",
                    "paused_at",
                    "cancelled_at",
                    "finished_at",
                    "recount_requested_at",
                    "links",
                )
            },
        ),
    )
    readonly_fields = tuple(
        str(name) for _, options in fieldsets[1:] for name in options["fields"]
    )

    def get_queryset(self, request) -> QuerySet:
        return super().get_queryset(request).select_related("created_by")

    def formfield_for_dbfield(self, db_field, request, **kwargs):
        if db_field.name == "requires":
            return RequiresField()
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def get_readonly_fields(self, request, obj: Batch | None = None) -> tuple:
        """A finished or cancelled batch's requirements are fixed."""
        fields = tuple(super().get_readonly_fields(request, obj))
        if obj is not None and (obj.cancelled_at or obj.finished_at):
            return (*fields, "requires")
        return fields

    def save_model(self, request, obj: Batch, form, change: bool) -> None:
        """The name is a plain field; priority, weight and max in flight change
        through their transition (an event with who and what, and a batch moved
        to another priority joins its rotation where the others are), and so do
        the requirements (refused, with a message, if the batch closed since
        the page was shown)."""
        obj.save(update_fields=["name"])
        transitions.set_share(
            obj,
            priority=form.cleaned_data["priority"],
            weight=form.cleaned_data["weight"],
            max_in_flight=form.cleaned_data["max_in_flight"],
            actor=request.user,
        )
        if "requires" in form.changed_data:
            try:
                transitions.set_requires(
                    obj, form.cleaned_data["requires"], actor=request.user
                )
            except BatchClosed as closed:
                self.message_user(
                    request,
                    f"The requirements were not changed. {closed}",
                    messages.ERROR,
                )

    def get_changelist(self, request, **kwargs) -> type[ChangeList]:
        return ProgressChangeList

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        live = [
            path(
                "live/",
                self.admin_site.admin_view(self.changelist_live),
                name="{}_{}_live".format(*info),
            ),
            path(
                "<path:object_id>/progress/",
                self.admin_site.admin_view(self.progress_live),
                name="{}_{}_progress".format(*info),
            ),
        ]
        return live + super().get_urls()

    # The live regions: the list's results and a batch's progress, fetched again
    # by static/js/recall.js (286 once nothing will change).

    def changelist_live(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        try:
            changelist = self.get_changelist_instance(request)
        except IncorrectLookupParameters:
            return HttpResponseBadRequest("Unknown filter.", content_type="text/plain")
        changelist.formset = None  # nothing is editable in the list
        response = render(
            request,
            "admin/batches/batch/_results_live.html",
            {"cl": changelist, "opts": self.opts},
        )
        return fragment(response, final=getattr(changelist, "final", False))

    def progress_live(self, request: HttpRequest, object_id: str) -> HttpResponse:
        batch = self.get_object(request, unquote(object_id))
        if batch is None:
            raise Http404("No such batch.")
        if not self.has_view_or_change_permission(request, batch):
            raise PermissionDenied
        progress = progress_for(batch, now=transitions.now())
        response = render(request, *self._progress_region(batch, progress))
        return fragment(response, final=progress.is_final)

    @staticmethod
    def _progress_region(batch: Batch, progress: Progress) -> tuple[str, dict]:
        return (
            "admin/batches/batch/_progress_live.html",
            {"batch": batch, "progress": progress},
        )

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        by_id = id_search(queryset, search_term)
        if by_id is not None:
            return by_id, False
        return super().get_search_results(request, queryset, search_term)

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    # Progress, on the list (``ProgressChangeList`` gave every row its own) and
    # on the change page (a live region).

    @admin.display(description="state")
    def state(self, batch: Any) -> str:
        return render_to_string("batches/_state.html", {"state": batch.progress.state})

    @admin.display(description="progress")
    def progress_column(self, batch: Any) -> str:
        return render_to_string(
            "admin/batches/batch/_row_progress.html", {"progress": batch.progress}
        )

    @admin.display(description="done")
    def done_percent(self, batch: Any) -> str:
        return f"{batch.progress.percent_done:.1f}%"

    @admin.display(description="throughput")
    def throughput(self, batch: Any) -> str:
        return format_html(
            '<span title="items done per minute, {}">{}/min</span>',
            batch.progress.throughput_window,
            f"{batch.progress.throughput_per_minute:.1f}",
        )

    @admin.display(description="ETA")
    def eta(self, batch: Any) -> str:
        progress = batch.progress
        if progress.waiting_for_worker:
            return format_html(
                '<span title="{}">{}</span><div class="small" data-waiting>{}</div>',
                progress.eta_basis,
                progress.eta_text,
                progress.waiting_text,
            )
        return progress.eta_text

    @admin.display(description="progress")
    def live_progress(self, batch: Batch) -> str:
        template, context = self._progress_region(
            batch, progress_for(batch, now=transitions.now())
        )
        # The refresh control sits beside the region, not in it (it survives
        # the region's refreshes).
        return format_html(
            '<div class="recall-refresh">{}</div>{}',
            render_to_string("_refresh.html"),
            render_to_string(template, context),
        )

    @admin.display(description="jobs")
    def jobs_column(self, batch: Batch) -> str:
        return changelist_link(Job, "jobs", batch__id__exact=batch.pk)

    @admin.display(description="links")
    def links(self, batch: Batch) -> str:
        return format_html(
            "{} · {} · {} · {}",
            changelist_link(Job, "jobs", batch__id__exact=batch.pk),
            changelist_link(
                Job, "failed jobs", batch__id__exact=batch.pk, status__exact="failed"
            ),
            changelist_link(BatchItem, "items", batch__id__exact=batch.pk),
            changelist_link(Event, "events", batch__id__exact=batch.pk),
        )


# Items one admin re-run takes (a selection across pages may name millions).
MAX_RERUN = 10_000


@admin.register(BatchItem)
class BatchItemAdmin(BigTableAdmin):
    list_display = (
        "id",
        "source_column",
        "status",
        "batch_column",
        "job_column",
        "duration_column",
        "flags_column",
    )
    list_filter = (
        "status",
        BatchFilter,
        *FLAG_COLUMNS.values(),  # quality flags (batches.flags)
    )
    list_select_related = ("batch", "job")
    search_fields = ("source",)
    search_help_text = (
        "An item id, part of its source (case matters), or words of its transcript."
    )
    fields = (
        "source",
        "status",
        "batch_column",
        "job_column",
        "params",
        "duration_column",
        "flags_column",
        "created_at",
        "updated_at",
    )
    readonly_fields = fields
    actions = ("rerun_items",)

    def get_queryset(self, request) -> QuerySet:
        return super().get_queryset(request).select_related("batch", "job")

    def has_rerun_permission(self, request: HttpRequest) -> bool:
        # The batch's change permission, as on the batch page and the API.
        return request.user.has_perm("batches.change_batch")

    @admin.action(
        description="Re-run the selected done or failed items",
        permissions=["rerun"],
    )
    def rerun_items(self, request: HttpRequest, queryset: QuerySet) -> None:
        """``transitions.rerun`` for the selected items that are done or
        failed, one re-run (one transaction, one event) per batch; the others
        are skipped. No requirement: the batch page and the Operator API take
        one."""
        chosen = queryset.filter(status__in=[ItemStatus.DONE, ItemStatus.FAILED])
        by_batch: dict[int, list[int]] = {}
        for batch_id, pk in chosen.values_list("batch_id", "pk")[:MAX_RERUN]:
            by_batch.setdefault(batch_id, []).append(pk)
        total = 0
        for batch_id, items in sorted(by_batch.items()):
            try:
                n = transitions.rerun(batch_id, items=items, actor=request.user)
            except (BatchClosed, RerunRefused) as refused:
                why = "it is cancelled" if isinstance(refused, BatchClosed) else refused
                self.message_user(
                    request,
                    f"Batch {batch_id}: nothing re-run ({why}).",
                    messages.WARNING,
                )
                continue
            log_change_by_id(
                request,
                [
                    (BatchItem, pk, f"item {pk}", "Re-run: queued again as a new run.")
                    for pk in items
                ],
            )
            total += n
        skipped = queryset.count() - sum(len(i) for i in by_batch.values())
        self.message_user(
            request,
            f"Re-running {total} item{'s' * (total != 1)} as a new run"
            + (f"; {skipped} skipped (not done or failed)" if skipped > 0 else "")
            + ".",
            messages.SUCCESS,
        )

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        by_id = id_search(queryset, term)
        if by_id is not None:
            return by_id, False
        # A scan of the items: case-sensitive LIKE is three times faster than ILIKE;
        # and the words of their transcripts (full-text index on PostgreSQL,
        # substrings on SQLite).
        by_source = queryset.filter(source__contains=term)
        return or_transcript(queryset, by_source, term, with_transcript), False

    @admin.display(description="source")
    def source_column(self, item: BatchItem) -> str:
        return Truncator(item.source).chars(80)

    @admin.display(description="batch")
    def batch_column(self, item: BatchItem) -> str:
        return link_to_id(Batch, item.batch_id, item.batch.name)

    @admin.display(description="job")
    def job_column(self, item: BatchItem) -> str:
        job = getattr(item, "job", None)
        if job is None:
            return "-"
        return link_to_id(Job, job.pk, f"job {job.pk} ({job.status})")

    @admin.display(description="duration")
    def duration_column(self, item: BatchItem) -> str:
        seconds = item.duration_seconds
        return "-" if seconds is None else f"{seconds:g} s"

    @admin.display(description="flags")
    def flags_column(self, item: BatchItem) -> str:
        return ", ".join(item.flags) or "-"
