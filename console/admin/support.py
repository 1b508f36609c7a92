"""Building blocks shared by Recall's admin pages (jobs and batches).

The admin lists tables of a million rows and more, and acts on "all N matching"
selections. What keeps that cheap and safe lives here: a paginator that does not
count a huge table on every page load, search that stays on indexes (and finds
transcripts through ``jobs.search``, the batch page's search), a batch
filter that does not list every batch, confirmation pages for actions, and
iteration over a selection's ids in short, separate queries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from django.conf import settings
from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html

from batches.models import Batch
from batches.numbers import MAX_ID, whole_number
from jobs.search import BadSearch, Search, parse_search

# Above this many rows (planner's estimate) an unfiltered list shows an estimate
# instead of running COUNT(*) over the whole table.
ESTIMATE_ABOVE = 100_000
# Rows listed by name on a confirmation page (the counts cover all of them).
SAMPLE_SIZE = 20
# Batches offered by the batch filter: the newest ones (plus the selected one).
RECENT_BATCHES = 15


class EstimatedCountPaginator(Paginator):
    """Counts exactly, except for an unfiltered list of a big PostgreSQL table.

    The admin counts the rows of every list it shows. COUNT(*) reads the whole
    table, so without a filter a table of millions of rows gets PostgreSQL's own
    estimate (``pg_class.reltuples``, kept by autovacuum). Filtered lists, small
    tables and SQLite are counted exactly. ``estimated`` tells the template.
    """

    estimated = False

    @cached_property
    def count(self) -> int:
        rows = self.object_list
        estimate = estimated_rows(rows) if isinstance(rows, QuerySet) else None
        if estimate is not None:
            self.estimated = True
            return estimate
        return super().count


class ReadOnlyAdmin(admin.ModelAdmin):
    """A model the admin shows but never adds, edits or deletes."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class BigTableAdmin(ReadOnlyAdmin):
    """Read-only list of a table that grows to millions of rows."""

    list_per_page = 100
    show_full_result_count = False  # no second COUNT(*) of the whole table
    show_facets = admin.ShowFacets.NEVER  # a facet is a COUNT per choice
    paginator = EstimatedCountPaginator
    ordering = ("-pk",)
    # Sorting by anything else sorts the whole table.
    sortable_by: ClassVar[tuple[str, ...]] = ("id",)


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


def estimated_rows(queryset: QuerySet) -> int | None:
    """The planner's row estimate for an unfiltered queryset over a big
    PostgreSQL table; None when it should be counted exactly."""
    connection = connections[queryset.db]
    if connection.vendor != "postgresql" or queryset.query.where:
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
            [queryset.model._meta.db_table],
        )
        row = cursor.fetchone()
    if row is None or row[0] < ESTIMATE_ABOVE:
        return None
    return row[0]


def as_id(term: str) -> int | None:
    """``term`` as a row id if it is a whole number, else None (a number too
    big for an id, however long, is MAX_ID + 1)."""
    return whole_number(term.strip())


def id_search(queryset: QuerySet, term: str, field: str = "pk") -> QuerySet | None:
    """Rows whose ``field`` equals the number ``term`` (an index lookup), or None
    if ``term`` is not a number. A number too big for an id matches nothing."""
    number = as_id(term)
    if number is None:
        return None
    if number > MAX_ID:
        return queryset.none()
    return queryset.filter(**{field: number})


def or_transcript(
    queryset: QuerySet,
    others: QuerySet,
    term: str,
    match: Callable[[QuerySet, Search], QuerySet],
) -> QuerySet:
    """The rows of ``queryset`` that ``others`` selects, or whose transcript
    has the words of ``term`` (``match``: ``jobs.search``'s match for this
    model, the batch page's and /search/'s); ``others`` alone when ``term``
    has no word to look for, or too many.

    As ``pk IN (A UNION B)``: each side keeps its own plan, the other fields'
    scan as before and the transcripts' full-text index; an OR of the two
    conditions could use neither index, and would compute the text-search
    vector of every completed job."""
    try:
        search = parse_search(term)
    except BadSearch:
        return others
    ids = [q.order_by().values("pk") for q in (others, match(queryset, search))]
    return queryset.filter(pk__in=ids[0].union(ids[1]))


class BatchFilter(admin.SimpleListFilter):
    """Filter by batch, offering only the newest batches: a list of every batch
    would be huge. Any batch can be chosen through a link from its own page
    (``?batch__id__exact=<id>``), and then shows as selected here."""

    title = "batch"
    parameter_name = "batch__id__exact"
    field = "batch_id"

    def lookups(self, request, model_admin) -> list[tuple[str, str]]:
        batches = list(
            Batch.objects.order_by("-pk").values_list("pk", "name")[:RECENT_BATCHES]
        )
        selected = as_id(self.value() or "")
        if selected is not None and selected not in {pk for pk, _ in batches}:
            batches += Batch.objects.filter(pk=min(selected, MAX_ID)).values_list(
                "pk", "name"
            )
        return [(str(pk), f"#{pk} {name}") for pk, name in batches]

    def queryset(self, request, queryset: QuerySet) -> QuerySet | None:
        if self.value() is None:
            return None
        number = as_id(self.value() or "")
        if number is None or number > MAX_ID:
            return queryset.none()
        return queryset.filter(**{self.field: number})


def admin_link(obj: Model | None, text: str | None = None) -> str:
    """A link to ``obj``'s admin page (or "-" when there is none)."""
    if obj is None:
        return "-"
    return link_to_id(obj._meta.model, obj.pk, str(obj) if text is None else text)


def link_to_id(model: type[Model], pk: int | None, text: str) -> str:
    """A link to the admin page of ``model`` row ``pk`` without loading the row."""
    if pk is None:
        return "-"
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])
    return format_html('<a href="{}">{}</a>', url, text)


def changelist_link(model: type[Model], text: str, **filters) -> str:
    """A link to ``model``'s admin list, filtered by ``filters`` (query string)."""
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    query = "&".join(f"{k}={v}" for k, v in filters.items())
    return format_html('<a href="{}?{}">{}</a>', url, query, text)


def id_chunks(queryset: QuerySet, size: int | None = None) -> Iterator[list[int]]:
    """The queryset's ids in ascending chunks, each read by a query of its own.

    Nothing is held between chunks, so acting on "all N matching" (the admin's
    select-all over a million rows) works in short transactions, one chunk at a
    time, and rows changed meanwhile are seen in their current state.
    """
    size = size or settings.RECALL_CHUNK_SIZE
    ids = queryset.order_by("pk").values_list("pk", flat=True)
    after = 0
    while chunk := list(ids.filter(pk__gt=after)[:size]):
        yield chunk
        after = chunk[-1]


def is_confirmed(request: HttpRequest) -> bool:
    """True on the POST from an action's confirmation page."""
    return request.POST.get("post") == "yes"


def selects_across(request: HttpRequest) -> bool:
    """True when the admin user chose "select all N matching"."""
    return request.POST.get("select_across") in ("1", "True", "true")


@dataclass
class Confirmation:
    """What an action's confirmation page says before anything changes."""

    title: str
    # What the action does, in a sentence.
    summary: str
    # Row counts: how many are selected, will change, will be skipped (and why).
    counts: list[tuple[str, int]] = field(default_factory=list)
    # What happens to each row that changes, and what else to know.
    effects: list[str] = field(default_factory=list)
    # The first rows that will change, as links; ``changing`` counts all of them.
    sample: list[str] = field(default_factory=list)
    changing: int = 0
    # The submit button's text; None when there is nothing to do.
    button: str | None = "Yes, go ahead"


def render_confirmation(
    model_admin: admin.ModelAdmin, request: HttpRequest, confirmation: Confirmation
) -> TemplateResponse:
    """The confirmation page: it posts the same selection back with ``post=yes``.

    The form posts to the list's own URL (with its filters and search), so "all
    N matching" means the same rows when the action runs; the counts are taken
    again then, since rows may change in between.
    """
    opts = model_admin.model._meta
    context = {
        **model_admin.admin_site.each_context(request),
        "title": confirmation.title,
        "subtitle": None,
        "opts": opts,
        "confirmation": confirmation,
        "more": max(confirmation.changing - len(confirmation.sample), 0),
        "action": request.POST.get("action", ""),
        "select_across": "1" if selects_across(request) else "0",
        "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": model_admin.media,
    }
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(request, "admin/jobs/confirm_action.html", context)


def _user_id(request: HttpRequest) -> int:
    """The acting admin's id (the admin lets no anonymous user act)."""
    if request.user.pk is None:
        raise PermissionDenied("Log in to act.")
    return int(request.user.pk)


def log_changes(request: HttpRequest, objects, message: str) -> None:
    """One admin LogEntry ("changed") per object, written in one INSERT."""
    objects = list(objects)
    if objects:
        LogEntry.objects.log_actions(
            user_id=_user_id(request),
            queryset=objects,
            action_flag=CHANGE,
            change_message=message,
        )


def log_change_by_id(
    request: HttpRequest, rows: list[tuple[type[Model], int | None, str, str]]
) -> None:
    """Admin LogEntry rows for rows given by (model, id, repr, message), without
    loading them; id None records an action on the model as a whole."""
    LogEntry.objects.bulk_create(
        LogEntry(
            user_id=_user_id(request),
            content_type=ContentType.objects.get_for_model(model),
            object_id=None if pk is None else str(pk),
            object_repr=text[:200],
            action_flag=CHANGE,
            change_message=message,
        )
        for model, pk, text, message in rows
    )
