"""The admin's lease ledger: every attempt, read-only."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from console.admin.support import BigTableAdmin, id_search, link_to_id
from jobs.models import Job, Lease


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
