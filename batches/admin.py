"""The Django admin for batches and their items.

Batches are created by intake (``manage.py create_batch`` or the operator UI),
which also creates their jobs and progress counters together; a batch made
here would have neither, so the admin cannot add one. Nor can it delete one:
the delete page would list every item and job of a million-item batch, and
deleting under live leases would leave workers with jobs that vanished (cancel
the batch instead). Only a batch's name and its share of the workers (priority,
weight, max in flight) are editable, the share through its transition; its
progress comes read-only from the sharded counters, never from counting items.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import IntegerField, OuterRef, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.text import Truncator

from jobs import transitions
from jobs.models import Event, Job

from .admin_support import (
    BatchFilter,
    BigTableAdmin,
    changelist_link,
    id_search,
    link_to_id,
)
from .models import Batch, BatchCounter, BatchItem, ItemStatus

PROGRESS = tuple(ItemStatus.values)  # queued, transcribing, done, failed, cancelled


def _counter_sum(column: str) -> Coalesce:
    """The sum of one counter column over a batch's shards (16 rows, on the
    (batch, shard) unique index), for the batches of one page only."""
    shards = (
        BatchCounter.objects.filter(batch=OuterRef("pk"))
        .order_by()
        .values("batch")
        .annotate(total=Sum(column))
        .values("total")
    )
    return Coalesce(Subquery(shards, output_field=IntegerField()), 0)


def batch_state(batch: Batch) -> str:
    """Operator intent first: cancelled, then finished, paused, running."""
    if batch.cancelled_at:
        return "cancelled"
    if batch.finished_at:
        return "finished"
    if batch.paused_at:
        return "paused"
    return "running"


class StateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin) -> list[tuple[str, str]]:
        return [(s, s) for s in ("running", "paused", "finished", "cancelled")]

    def queryset(self, request, queryset: QuerySet) -> QuerySet | None:
        filters = {
            "running": {
                "cancelled_at__isnull": True,
                "finished_at__isnull": True,
                "paused_at__isnull": True,
            },
            "paused": {
                "cancelled_at__isnull": True,
                "finished_at__isnull": True,
                "paused_at__isnull": False,
            },
            "finished": {"cancelled_at__isnull": True, "finished_at__isnull": False},
            "cancelled": {"cancelled_at__isnull": False},
        }
        value = self.value()
        if value is None:
            return None
        if value not in filters:
            return queryset.none()
        return queryset.filter(**filters[value])


class BatchForm(forms.ModelForm):
    """A weight left empty keeps the batch's weight."""

    class Meta:
        model = Batch
        fields = ("name", "priority", "weight", "max_in_flight")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["weight"].required = False

    def clean_weight(self) -> int:
        weight = self.cleaned_data.get("weight")
        return self.instance.weight if weight is None else weight


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    form = BatchForm
    list_display = (
        "id",
        "name",
        "priority",
        "weight",
        "max_in_flight",
        "state",
        "total",
        *PROGRESS,
        "finished_percent",
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
        (None, {"fields": ("name", "priority", "weight", "max_in_flight")}),
        (
            "Progress (from the counters)",
            {"fields": ("state", "total", *PROGRESS, "finished_percent")},
        ),
        (
            "Details",
            {
                "fields": (
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
        return (
            super()
            .get_queryset(request)
            .select_related("created_by")
            .annotate(**{f"n_{s}": _counter_sum(s) for s in PROGRESS})
        )

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        by_id = id_search(queryset, search_term)
        if by_id is not None:
            return by_id, False
        return super().get_search_results(request, queryset, search_term)

    def save_model(self, request, obj: Batch, form, change: bool) -> None:
        """The name is a plain field; priority, weight and max in flight change
        through their transition (an event with who and what, and a batch moved
        to another priority joins its rotation where the others are)."""
        obj.save(update_fields=["name"])
        transitions.set_share(
            obj,
            priority=form.cleaned_data["priority"],
            weight=form.cleaned_data["weight"],
            max_in_flight=form.cleaned_data["max_in_flight"],
            actor=request.user,
        )

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    # Progress: annotated from the counters (get_queryset), list and change page;
    # ``batch`` is a Batch with ``n_<status>`` annotations.

    @admin.display(description="state")
    def state(self, batch: Batch) -> str:
        return batch_state(batch)

    @admin.display(description="queued", ordering="n_queued")
    def queued(self, batch: Any) -> int:
        return batch.n_queued

    @admin.display(description="transcribing", ordering="n_transcribing")
    def transcribing(self, batch: Any) -> int:
        return batch.n_transcribing

    @admin.display(description="done", ordering="n_done")
    def done(self, batch: Any) -> int:
        return batch.n_done

    @admin.display(description="failed", ordering="n_failed")
    def failed(self, batch: Any) -> int:
        return batch.n_failed

    @admin.display(description="cancelled", ordering="n_cancelled")
    def cancelled(self, batch: Any) -> int:
        return batch.n_cancelled

    @admin.display(description="finished")
    def finished_percent(self, batch: Any) -> str:
        if not batch.total:
            return "-"
        finished = batch.n_done + batch.n_failed + batch.n_cancelled
        return f"{100 * finished / batch.total:.1f}%"

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


@admin.register(BatchItem)
class BatchItemAdmin(BigTableAdmin):
    list_display = (
        "id",
        "source_column",
        "status",
        "batch_column",
        "job_column",
        "duration_column",
    )
    list_filter = ("status", BatchFilter)
    list_select_related = ("batch", "job")
    search_fields = ("source",)
    search_help_text = "An item id, or part of its source (case matters)."
    fields = (
        "source",
        "status",
        "batch_column",
        "job_column",
        "params",
        "duration_column",
        "created_at",
        "updated_at",
    )
    readonly_fields = fields

    def get_queryset(self, request) -> QuerySet:
        return super().get_queryset(request).select_related("batch", "job")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        by_id = id_search(queryset, term)
        if by_id is not None:
            return by_id, False
        # A scan of the items: case-sensitive LIKE is three times faster than ILIKE.
        return queryset.filter(source__contains=term), False

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
