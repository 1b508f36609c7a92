"""Django's admin log, browsable: who did what, when, to which row."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.utils.html import format_html

from console.admin.support import BigTableAdmin


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
