"""Operator pages: batches, batch detail, items, intake, actions and exports.

Thin views: check the permission, parse the input, call one transition (or
read), render. Every page needs a login and ``batches.view_batch``; actions are POST
with CSRF and their own permission. The live regions of a page are rendered by
the same templates as the page, so the page works without JavaScript and the
refreshing script only swaps fragments.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import wraps

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.core.exceptions import RequestDataTooBig
from django.core.paginator import Paginator
from django.db.models import Count, Prefetch, QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    JsonResponse,
)
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404, redirect, render
from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_GET, require_POST

from batches.flags import FLAG_COLUMNS
from batches.intake_records import Intake, IntakeStatus
from batches.labels import LabelError, format_pairs
from batches.models import Batch, BatchItem, ItemStatus
from batches.numbers import MAX_ID, whole_number
from batches.roles import viewer_required
from batches.streaming import EXPORTS, export_response
from console.forms import (
    ItemFilterForm,
    NewBatchForm,
    RequiresForm,
    RerunForm,
    ShareForm,
)
from console.live import fragment
from console.uploads import ManifestSizeLimit, ManifestTooLarge
from engine.background_intake import stale_after, start_intake
from engine.manifests import LineError, ManifestInvalid, create_batch
from engine.progress import (
    BatchState,
    Progress,
    chart_geometry,
    format_duration,
    in_state,
    progress_for,
    progress_for_many,
)
from jobs import transitions
from jobs.exceptions import BatchClosed, RerunRefused
from jobs.models import (
    DeliveryStatus,
    Job,
    JobStatus,
    WebhookDelivery,
    WebhookEvent,
    WebhookEventType,
)
from jobs.search import BadSearch, parse_search, through_the_index, with_transcript

ITEMS_PER_PAGE = 50
BATCHES_PER_PAGE = 25
# A request starts no new chunk of a bulk action after this long (gunicorn's
# timeout is 60 s); reconciliation finishes a cancel that was cut short.
ACTION_SECONDS = 20


# --- Batches list ------------------------------------------------------------------


def _batches(request: HttpRequest):
    """The filtered batches (state, name search), newest first."""
    batches: QuerySet[Batch] = Batch.objects.order_by("-created_at", "-pk")
    q = request.GET.get("q", "").strip().replace("\x00", "")
    if q:
        batches = batches.filter(name__icontains=q)
    state = request.GET.get("state", "")
    if state in BatchState.ALL:
        batches = in_state(batches, state, now=transitions.now())
    return batches, q, state


def _list_context(request: HttpRequest) -> dict:
    batches, q, state = _batches(request)
    page = Paginator(batches, BATCHES_PER_PAGE).get_page(request.GET.get("page"))
    progress = progress_for_many(list(page), now=transitions.now())
    rows = [progress[b.pk] for b in page]
    return {
        "page": page,
        "rows": rows,
        "q": q,
        "state": state,
        "states": BatchState.ALL,
        "final": all(p.is_final for p in rows),
        "query": request.GET.urlencode(),
        "nav": "batches",
    }


@require_GET
@viewer_required
def batch_list(request: HttpRequest) -> HttpResponse:
    return render(request, "batches/list.html", _list_context(request))


@require_GET
@viewer_required
def batch_list_live(request: HttpRequest) -> HttpResponse:
    context = _list_context(request)
    response = render(request, "batches/_list_live.html", context)
    return fragment(response, final=context["final"])


# --- Batch detail --------------------------------------------------------------------


def _items(batch: Batch, form: ItemFilterForm, progress: Progress):
    """The batch's items the filter selects, in the order of the index that
    serves them, and how many there are when the counters know it.

    The batch (and the state) are written as ranges that hold one value, and
    the order names them: an equality would let PostgreSQL drop them from the
    order and walk the primary key (or merge-join every job) from the first
    item of the table, guessing that the batch's rows are spread evenly. For
    the largest batch among ten million items that guess cost seconds.
    """
    items = (
        BatchItem.objects.filter(batch_id__gte=batch.pk, batch_id__lte=batch.pk)
        .select_related("job")
        .only(
            "id",
            "source",
            "status",
            "updated_at",
            "job__id",
            "job__attempts",
            *FLAG_COLUMNS.values(),
        )
    )
    counts = progress.counts
    state = form.cleaned_data.get("state") if form.is_valid() else ""
    flag = form.cleaned_data.get("flag") if form.is_valid() else ""
    q = form.cleaned_data.get("q") if form.is_valid() else ""
    order: tuple[str, ...] = ("batch_id", "pk")
    if flag:
        # The flag's partial index on (batch, id) serves it; only done items
        # have flags, so a state filter beside it is a plain condition.
        items = items.filter(**{FLAG_COLUMNS[flag]: True})
        if state:
            items = items.filter(status=state)
    elif state:
        items = items.filter(status__gte=state, status__lte=state)
        order = ("batch_id", "status", "pk")
    if q:
        # Sources by substring (a scan of the batch's sources), and transcripts
        # by their words (jobs.search, the index on PostgreSQL): two queries
        # whose pages are merged, so each keeps its own plan.
        choices = [items.filter(source__icontains=q)]
        try:
            search = parse_search(q)
        except BadSearch:  # no word to look for: the source match alone
            search = None
        if search is not None:
            choices.append(
                with_transcript(items.filter(job__batch_id=batch.pk), search)
            )
        return choices, order, None
    # Without a search, the counters already know how many rows match.
    if flag:
        known = state in ("", ItemStatus.DONE)
        return [items], order, progress.flags[flag] if known else 0
    return [items], order, counts[state] if state else sum(counts.values())


@dataclass
class ItemsPage:
    """One page of items by keyset (``id`` after or before a cursor): as fast on
    the last page of a million items as on the first, unlike OFFSET."""

    object_list: list
    count: int | None
    newer: int | None  # cursor for the previous page (``before``)
    older: int | None  # cursor for the next page (``after``)
    at_start: bool
    at_end: bool


def _backwards(order: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"-{field}" for field in order)


def _items_page(
    choices: Sequence[QuerySet],
    order: tuple[str, ...],
    request: HttpRequest,
    count: int | None,
) -> ItemsPage:
    """One keyset page of the items any of ``choices`` selects (a search's
    source matches and transcript matches are two), merged in id order."""

    def cursor(name: str) -> int | None:
        number = whole_number(request.GET.get(name, ""))
        return number if number is not None and number <= MAX_ID else None

    def rows_of(ordering: tuple[str, ...], n: int, **where: int) -> list:
        found: dict[int, BatchItem] = {}
        for k, items in enumerate(choices):
            # The transcripts' choice (a search's second) through its index.
            with through_the_index() if k else nullcontext():
                for row in items.filter(**where).order_by(*ordering)[:n]:
                    found.setdefault(row.pk, row)
        descending = ordering[-1].startswith("-")
        return sorted(found.values(), key=lambda r: r.pk, reverse=descending)[:n]

    def nearest(ordering: tuple[str, ...], **where: int) -> bool:
        # Ordered, not exists(): unordered, PostgreSQL may answer from a scan
        # of the whole table that it expects to stop early.
        for k, items in enumerate(choices):
            with through_the_index() if k else nullcontext():
                if list(
                    items.filter(**where).order_by(*ordering).values_list("pk")[:1]
                ):
                    return True
        return False

    after, before = cursor("after"), cursor("before")
    backwards = _backwards(order)
    if request.GET.get("last") == "1":
        rows = rows_of(backwards, ITEMS_PER_PAGE)[::-1]
    elif before is not None:
        rows = rows_of(backwards, ITEMS_PER_PAGE, pk__lt=before)[::-1]
    else:
        rows = rows_of(order, ITEMS_PER_PAGE, pk__gt=after or 0)
    at_start = not rows or not nearest(backwards, pk__lt=rows[0].pk)
    at_end = not rows or not nearest(order, pk__gt=rows[-1].pk)
    return ItemsPage(
        object_list=rows,
        count=count,
        newer=None if at_start else rows[0].pk,
        older=None if at_end else rows[-1].pk,
        at_start=at_start,
        at_end=at_end,
    )


# Finishes of a batch whose webhook deliveries the page shows (newest first).
WEBHOOK_EVENTS_SHOWN = 5


def _webhooks(batch: Batch) -> dict:
    """The batch's batch.finished events with their deliveries' state, and the
    state of its item.failed deliveries, counted (two or three small queries)."""
    deliveries = WebhookDelivery.objects.select_related("endpoint").order_by("pk")
    events = list(
        WebhookEvent.objects.for_batch(batch)
        .filter(type=WebhookEventType.BATCH_FINISHED)
        .prefetch_related(Prefetch("deliveries", queryset=deliveries))
        .order_by("-pk")[:WEBHOOK_EVENTS_SHOWN]
    )
    item_failed = dict(
        WebhookDelivery.objects.filter(
            event__batch=batch, event__type=WebhookEventType.ITEM_FAILED
        )
        .values("status")
        .annotate(n=Count("pk"))
        .values_list("status", "n")
        .order_by()
    )
    pending = item_failed.get(DeliveryStatus.PENDING, 0) > 0 or any(
        d.status == DeliveryStatus.PENDING
        for event in events
        for d in event.deliveries.all()
    )
    return {
        "events": events,
        "item_failed": item_failed,
        "item_failed_total": sum(item_failed.values()),
        "pending": pending,
    }


def _detail_context(request: HttpRequest, batch: Batch, *, chart: bool = True) -> dict:
    now = transitions.now()
    progress = progress_for(batch, now=now, chart=chart)
    form = ItemFilterForm(request.GET)
    items, order, count = _items(batch, form, progress)
    page = _items_page(items, order, request, count)
    user = request.user
    webhooks = _webhooks(batch) if chart else None
    return {
        "batch": batch,
        "progress": progress,
        "chart": chart_geometry(progress.chart) if chart else None,
        "webhooks": webhooks,
        # The live region refreshes until the batch is final and its webhooks
        # are delivered (or given up).
        "live_final": progress.is_final and not (webhooks and webhooks["pending"]),
        "form": form,
        "page": page,
        "filtered": bool(
            form.is_valid()
            and (
                form.cleaned_data["q"]
                or form.cleaned_data["state"]
                or form.cleaned_data["flag"]
            )
        ),
        # A text search scans the batch's sources: it is not re-run every few seconds.
        "searching": bool(form.is_valid() and form.cleaned_data["q"]),
        "query": request.GET.urlencode(),
        # The filter alone, for the pager's links.
        "filter_query": _without(request, "after", "before", "last", "page"),
        "can_operate": user.has_perm("batches.operate_batch"),
        "share_form": ShareForm(
            initial={
                "priority": batch.priority,
                "weight": batch.weight,
                "max_in_flight": batch.max_in_flight,
            }
        ),
        # Who may change what the batch requires of workers (while it is open).
        "can_change": user.has_perm("batches.change_batch"),
        "requires_form": RequiresForm(initial={"requires": batch.requires}),
        # Re-run (the change permission too): ticked items or a flag.
        # Its own ids: the requirements' and the filters' forms on this page
        # have fields of the same names (requires, flag).
        "rerun_form": RerunForm(auto_id="rerun_%s"),
        "rerun_allowed": user.has_perm("batches.change_batch")
        and batch.cancelled_at is None,
        "live_leases": Job.objects.filter(status=JobStatus.LEASED).count(),
        "can_export": user.has_perm("batches.export_batch"),
        # Webhook URLs often carry the receiver's credentials (a path or query
        # token): only those who may see the endpoints see them whole.
        "can_see_webhook_urls": user.has_perm("jobs.view_webhookendpoint"),
        "stalled_after": format_duration(settings.RECALL_STALLED_AFTER_SECONDS),
        "nav": "batches",
    }


def _without(request: HttpRequest, *names: str) -> str:
    params = request.GET.copy()
    for name in names:
        params.pop(name, None)
    return params.urlencode()


@require_GET
@viewer_required
def batch_detail(request: HttpRequest, pk: int) -> HttpResponse:
    batch = get_object_or_404(Batch, pk=pk)
    return render(request, "batches/detail.html", _detail_context(request, batch))


@require_GET
@viewer_required
def batch_live(request: HttpRequest, pk: int) -> HttpResponse:
    batch = get_object_or_404(Batch, pk=pk)
    context = _detail_context(request, batch)
    response = render(request, "batches/_detail_live.html", context)
    return fragment(response, final=context["live_final"])


@require_GET
@viewer_required
def batch_items_live(request: HttpRequest, pk: int) -> HttpResponse:
    batch = get_object_or_404(Batch, pk=pk)
    context = _detail_context(request, batch, chart=False)
    response = render(request, "batches/_items.html", context)
    return fragment(response, final=context["progress"].is_final)


@require_GET
@viewer_required
def batch_progress(request: HttpRequest, pk: int) -> JsonResponse:
    batch = get_object_or_404(Batch, pk=pk)
    progress = progress_for(batch, now=transitions.now(), retry=True)
    response = JsonResponse(progress.as_json())
    response["Cache-Control"] = "no-store"
    return response


# --- Item detail ---------------------------------------------------------------------


@require_GET
@viewer_required
def item_detail(request: HttpRequest, pk: int) -> HttpResponse:
    item = get_object_or_404(
        BatchItem.objects.select_related("batch", "job__leased_by"), pk=pk
    )
    job = item.job
    leases = list(job.leases.select_related("worker").order_by("claimed_at", "pk"))
    events = job.events.select_related("actor").order_by("-created_at", "-pk")
    # Earlier runs (re-runs keep them), newest first; each lease is shown with
    # the run it belonged to (its ledger row id is at most the run's last).
    runs = list(job.runs.select_related("worker", "rerun_by").order_by("-number"))
    for lease in leases:
        lease.run = min(  # type: ignore[attr-defined]
            (r.number for r in runs if r.last_lease_id and lease.pk <= r.last_lease_id),
            default=job.run,
        )
    for run in runs:
        text = run.result.get("text") if isinstance(run.result, dict) else None
        run.text = text if isinstance(text, str) else ""  # type: ignore[attr-defined]
    # A stored result is read as it is: rows written before the API checked
    # them as closely may hold any JSON value.
    result = job.result if isinstance(job.result, dict) else {}
    text = result.get("text", "")
    text = text if isinstance(text, str) else ""
    segments = result.get("segments")
    return render(
        request,
        "batches/item.html",
        {
            "item": item,
            "batch": item.batch,
            "job": job,
            "leases": leases,
            "events": events,
            "runs": runs,
            "transcript": text[:5000],
            "transcript_truncated": len(text) > 5000,
            "segments": len(segments) if isinstance(segments, list) else 0,
            "language": result.get("language", ""),
            "now": transitions.now(),
            "nav": "batches",
        },
    )


# --- Intake -------------------------------------------------------------------------


@login_required
@permission_required("batches.add_batch", raise_exception=True)
@csrf_exempt  # checked inside, where an oversized body can get a clear answer
def batch_new(request: HttpRequest) -> HttpResponse:
    # Before anything reads the body: the size limit applies while it arrives.
    request.upload_handlers.insert(0, ManifestSizeLimit(request))
    try:
        return _batch_new(request)
    except RequestDataTooBig:
        # Nothing is read or written: the body was refused before the form saw it.
        limit = filesizeformat(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        return _new_form(
            request,
            NewBatchForm(),
            top_errors=[
                f"The pasted text is larger than {limit}; upload it as a file instead."
            ],
            status=413,
        )
    except ManifestTooLarge as too_large:
        # Reading stopped at the limit: the rest of the file was never stored.
        return _new_form(
            request,
            NewBatchForm(),
            top_errors=[
                f"The file is larger than {filesizeformat(too_large.limit)}, the "
                f"limit; Recall stopped reading it and created nothing. Split it "
                f"into several batches, or use the create_batch command."
            ],
            status=413,
        )


@csrf_protect
def _batch_new(request: HttpRequest) -> HttpResponse:
    if request.method == "GET":
        return _new_form(request, NewBatchForm())
    if request.method != "POST":
        return HttpResponse(status=405, headers={"Allow": "GET, POST"})
    form = NewBatchForm(request.POST, request.FILES)
    if not form.is_valid():
        return _new_form(request, form, status=400)
    upload = form.cleaned_data.get("manifest")
    try:
        if upload and upload.size > settings.RECALL_BACKGROUND_INTAKE_BYTES:
            # Too long for a web request: the cluster takes it from here.
            intake = start_intake(
                form.cleaned_data["name"],
                upload,
                priority=form.cleaned_data["priority"],
                weight=form.cleaned_data["weight"],
                max_in_flight=form.cleaned_data["max_in_flight"],
                created_by=request.user,
                requires=form.cleaned_data["requires"],
            )
            return redirect("intake-detail", pk=intake.pk)
        batch = create_batch(
            form.cleaned_data["name"],
            _opener(form.cleaned_data),
            priority=form.cleaned_data["priority"],
            weight=form.cleaned_data["weight"],
            max_in_flight=form.cleaned_data["max_in_flight"],
            created_by=request.user,
            requires=form.cleaned_data["requires"],
        )
    except ManifestInvalid as invalid:
        return _new_form(
            request,
            form,
            top_errors=[
                f"The manifest has {invalid.total_errors} problem(s); nothing was "
                f"created. Fix them and submit again."
            ],
            line_errors=invalid.errors,
            more_errors=invalid.total_errors - len(invalid.errors),
            status=400,
        )
    messages.success(request, f"Created batch “{batch.name}” with {batch.total} items.")
    return redirect("batch-detail", pk=batch.pk)


@require_GET
@viewer_required
def intake_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A background intake: its progress, then its batch (or what was wrong)."""
    intake = get_object_or_404(Intake.objects.select_related("batch"), pk=pk)
    if intake.status == IntakeStatus.DONE and intake.batch is not None:
        return redirect("batch-detail", pk=intake.batch.pk)
    now = transitions.now()
    waiting = intake.status in (IntakeStatus.QUEUED, IntakeStatus.RUNNING)
    quiet = now - intake.updated_at
    response = render(
        request,
        "batches/intake.html",
        {
            "intake": intake,
            "waiting": waiting,
            "interrupted": waiting and quiet > stale_after(),
            "no_cluster": intake.status == IntakeStatus.QUEUED
            and quiet > timedelta(seconds=30),
            "elapsed": format_duration((now - intake.created_at).total_seconds()),
            "line_errors": [LineError(e["line"], e["message"]) for e in intake.errors],
            "more_errors": intake.total_errors - len(intake.errors),
            "nav": "new",
        },
    )
    response["Cache-Control"] = "no-store"
    return response


def _new_form(
    request: HttpRequest,
    form: NewBatchForm,
    *,
    top_errors: Sequence[str] = (),
    line_errors: Sequence[object] = (),
    more_errors: int = 0,
    status: int = 200,
) -> HttpResponse:
    return render(
        request,
        "batches/new.html",
        {
            "form": form,
            "top_errors": [*top_errors, *form.non_field_errors()],
            "line_errors": line_errors,
            "more_errors": more_errors,
            "max_bytes": settings.RECALL_MAX_MANIFEST_BYTES,
            "max_items": settings.RECALL_MAX_MANIFEST_ITEMS,
            "nav": "new",
        },
        status=status,
    )


def _opener(cleaned: dict):
    """A fresh iterable of the manifest's lines, as often as intake asks."""
    upload = cleaned.get("manifest")
    if upload:

        def lines():
            upload.seek(0)
            return iter(upload)

        return lines
    text = cleaned["sources"]
    return lambda: io.StringIO(text)


# --- Actions ------------------------------------------------------------------------


def operator_action(view):
    """POST, logged in, ``batches.operate_batch`` (403 otherwise)."""

    @require_POST
    @login_required
    @permission_required("batches.operate_batch", raise_exception=True)
    @wraps(view)
    def wrapper(request, pk):
        batch = get_object_or_404(Batch, pk=pk)
        view(request, batch)
        return redirect(_back(request, batch))

    return wrapper


def _back(request: HttpRequest, batch: Batch) -> str:
    query = request.POST.get("return_query", "")
    url = reverse("batch-detail", args=[batch.pk])
    return f"{url}?{query}" if query and "\n" not in query else url


@operator_action
def batch_pause(request: HttpRequest, batch: Batch) -> None:
    if transitions.pause_batch(batch, actor=request.user):
        messages.success(
            request, "Paused: no new work is handed out; leases in flight finish."
        )
    else:
        messages.info(request, "The batch was already paused.")


@operator_action
def batch_resume(request: HttpRequest, batch: Batch) -> None:
    if transitions.resume_batch(batch, actor=request.user):
        messages.success(request, "Resumed.")
    else:
        messages.info(request, "The batch was not paused.")


@operator_action
def batch_cancel(request: HttpRequest, batch: Batch) -> None:
    if batch.cancelled_at:
        messages.info(request, "The batch was already cancelled.")
        return
    cancelled = transitions.cancel_batch(
        batch, actor=request.user, time_limit=ACTION_SECONDS
    )
    counts = batch.counts()
    left = counts[ItemStatus.QUEUED] + counts[ItemStatus.TRANSCRIBING]
    messages.success(
        request,
        f"Cancelled: {cancelled} queued or in-flight item(s) cancelled. "
        f"Finished items keep their results."
        + (f" The other {left} are being cancelled in the background." if left else ""),
    )


@operator_action
def batch_share(request: HttpRequest, batch: Batch) -> None:
    form = ShareForm(request.POST)
    if not form.is_valid():
        problems = "; ".join(
            f"{form.fields[name].label or name.replace('_', ' ').capitalize()}: "
            f"{' '.join(str(error) for error in errors)}"
            for name, errors in form.errors.items()
        )
        messages.error(request, f"Nothing was changed. {problems}")
        return
    changes = transitions.set_share(
        batch,
        priority=form.cleaned_data["priority"],
        weight=form.cleaned_data["weight"],
        max_in_flight=form.cleaned_data["max_in_flight"],
        actor=request.user,
    )
    if changes:
        messages.success(
            request, "Changed " + ", ".join(changes) + "; the next claim follows it."
        )
    else:
        messages.info(request, "Nothing to change.")


@require_POST
@login_required
@permission_required("batches.change_batch", raise_exception=True)
def batch_requires(request: HttpRequest, pk: int) -> HttpResponse:
    """Change the worker labels the batch requires (``set_requires``): the
    batch's change permission, as in the admin; refused once it is closed."""
    batch = get_object_or_404(Batch, pk=pk)
    form = RequiresForm(request.POST)
    if not form.is_valid():
        errors = " ".join(str(e) for e in form.errors.get("requires", []))
        messages.error(request, f"Nothing was changed. {errors}")
        return redirect(_back(request, batch))
    try:
        change = transitions.set_requires(
            batch, form.cleaned_data["requires"], actor=request.user
        )
    except BatchClosed as closed:
        messages.error(request, f"Nothing was changed. {closed}")
        return redirect(_back(request, batch))
    if change:
        messages.success(request, f"Changed {change}; the next claim follows it.")
    else:
        messages.info(request, "Nothing to change.")
    return redirect(_back(request, batch))


# Items one re-run from the page may name (a page shows at most 100).
MAX_RERUN_ITEMS = 1000


@require_POST
@login_required
@permission_required("batches.change_batch", raise_exception=True)
def batch_rerun(request: HttpRequest, pk: int) -> HttpResponse:
    """Re-run the ticked done or failed items, or every done item with a flag
    (``transitions.rerun``), optionally requiring worker labels of the new
    run: the batch's change permission, as the Operator API's re-run."""
    batch = get_object_or_404(Batch, pk=pk)
    form = RerunForm(request.POST)
    back = redirect(_back(request, batch) + "#items")
    if not form.is_valid():
        problems = " ".join(str(e) for errors in form.errors.values() for e in errors)
        messages.error(request, f"Nothing was re-run. {problems}")
        return back
    flag = form.cleaned_data["flag"] or None
    raw = request.POST.getlist("item")
    items = [whole_number(value) for value in raw[: MAX_RERUN_ITEMS + 1]]
    if flag is None and not raw:
        messages.error(
            request, "Nothing was re-run: tick the items to re-run, or choose a flag."
        )
        return back
    if flag is None and (
        len(raw) > MAX_RERUN_ITEMS
        or any(i is None or not 0 < i <= MAX_ID for i in items)
    ):
        messages.error(request, "Nothing was re-run: the items ticked are not valid.")
        return back
    try:
        n = transitions.rerun(
            batch,
            items=None if flag else [i for i in items if i is not None],
            flag=flag,
            requires=form.cleaned_data["requires"],
            actor=request.user,
        )
    except BatchClosed:
        messages.error(request, "Nothing was re-run: the batch is cancelled.")
        return back
    except RerunRefused as refused:
        messages.error(request, str(refused))
        return back
    except LabelError as error:
        messages.error(request, f"Nothing was re-run. {error}.")
        return back
    need = form.cleaned_data["requires"]
    scope = f" flagged {flag}" if flag else ""
    messages.success(
        request,
        f"Re-running {n} item{'s' * (n != 1)}{scope}"
        + (f" on workers offering {format_pairs(need)}" if need else "")
        + ": queued as a new run; the earlier results stay in each item's history.",
    )
    return back


@operator_action
def batch_retry(request: HttpRequest, batch: Batch) -> None:
    if batch.cancelled_at:
        messages.error(request, "A cancelled batch cannot be retried.")
        return
    jobs = Job.objects.filter(batch=batch)
    q = request.POST.get("q", "").strip().replace("\x00", "")
    if q:
        jobs = jobs.filter(item__source__icontains=q)
    queued = transitions.retry_failed(jobs, actor=request.user)
    scope = f" matching “{q}”" if q else ""
    messages.success(
        request, f"Queued {queued} failed item(s){scope} again, with fresh attempts."
    )


# --- Exports -------------------------------------------------------------------------


@require_GET
@login_required
@permission_required("batches.export_batch", raise_exception=True)
def batch_export(request: HttpRequest, pk: int, fmt: str) -> HttpResponseBase:
    if fmt not in EXPORTS:
        raise Http404("No such export format.")
    batch = get_object_or_404(Batch, pk=pk)
    streaming = export_response(batch, fmt)
    if streaming is not None:
        return streaming
    response = render(
        request,
        "batches/export_busy.html",
        {"batch": batch, "limit": settings.RECALL_EXPORTS_PER_PROCESS},
        status=503,
    )
    response["Retry-After"] = "30"
    return response
