"""The admin's event log: Recall's own audit and repair log, read-only."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.text import Truncator

from batches.models import Batch
from console.admin.support import BatchFilter, BigTableAdmin, id_search, link_to_id
from jobs.models import Event, Job


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
