"""Operator JSON API v1: pipelines submit batches, follow them and fetch results.

Every endpoint is authenticated by ``Authorization: Bearer <API token>`` (a
user's personal token, never a worker's and never a session cookie, so CSRF
does not apply) and checks the token's user's permission: the same permission
the operator UI checks for the same thing. Errors are ``{"error", "detail"}``
as in the worker API (``api.jsonapi``). Views parse, call what the UI calls
(intake, transitions, progress, exports) and render.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import wraps
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt

from api.jsonapi import ApiError, bad_request, field, json_object_body
from api.worker_views import MAX_DB_ID
from batches.flags import FLAG_COLUMNS, FLAGS
from batches.labels import LabelError, clean_labels
from batches.models import MAX_IN_FLIGHT, MAX_WEIGHT, Batch, BatchItem, ItemStatus
from batches.numbers import whole_number
from batches.streaming import EXPORTS, export_response
from engine.manifests import (
    MAX_REPORTED_ERRORS,
    ItemsInvalid,
    ManifestInvalid,
    create_batch_from_items,
)
from engine.progress import BatchState, in_state, progress_for, progress_for_many
from jobs import transitions
from jobs.exceptions import BatchClosed, RerunRefused
from jobs.models import Job
from jobs.search import (
    BadSearch,
    in_windows,
    item_ids,
    parse_search,
    through_the_index,
)
from operator_api import tokens
from operator_api.idempotency import IdempotencyConflict, body_hash, submit_once
from operator_api.models import MAX_IDEMPOTENCY_KEY_CHARS

PAGE_SIZE = 100
# What the token's user needs, by kind of request (the operator UI's rules).
READ = "batches.view_batch"
SUBMIT = "batches.add_batch"
OPERATE = "batches.operate_batch"
CHANGE = "batches.change_batch"
EXPORT = "batches.export_batch"
BATCH_FIELDS = frozenset(
    {"name", "priority", "weight", "max_in_flight", "requires", "items"}
)
MAX_SEARCH_CHARS = 200
RERUN_FIELDS = frozenset({"items", "flag", "requires"})
# Item ids one re-run may name (a flag selects any number).
MAX_RERUN_ITEMS = 10_000
# A request starts no new chunk of a cancel after this long (as the UI's).
ACTION_SECONDS = 20


def operator_endpoint(
    method: str, permission: str
) -> Callable[[Callable[..., HttpResponseBase]], Callable[..., HttpResponseBase]]:
    """``method`` only, API token auth, ``permission`` (403 otherwise); domain
    errors to JSON. The view gets the user and the request's time."""

    def decorate(view: Callable[..., HttpResponseBase]) -> Callable[..., Any]:
        @csrf_exempt
        @wraps(view)
        def wrapper(request: HttpRequest, **kwargs: Any) -> HttpResponseBase:
            try:
                if request.method != method:
                    raise _not_allowed(request, method)
                user, now = authenticate(request)
                if not user.has_perm(permission):
                    raise ApiError(
                        403,
                        "forbidden",
                        f"User {user.get_username()!r} may not do this "
                        f"(it needs the {permission!r} permission).",
                    )
                return view(request, user, now=now, **kwargs)
            except ApiError as error:
                return error.response()

        return wrapper

    return decorate


def _not_allowed(request: HttpRequest, *allowed: str) -> ApiError:
    return ApiError(
        405,
        "method_not_allowed",
        f"{request.method} is not allowed here; use {' or '.join(allowed)}.",
        {"Allow": ", ".join(allowed)},
    )


def authenticate(request: HttpRequest) -> tuple[Any, datetime]:
    """The user whose API token made the request, and the request's time."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized("Send an API token as 'Authorization: Bearer <token>'.")
    api_token = tokens.authenticate(token)
    if api_token is None:
        if not token.startswith(tokens.TOKEN_MARK):
            raise _unauthorized(
                "This is not an API token (they start with "
                f"{tokens.TOKEN_MARK!r}); worker tokens are refused here."
            )
        raise _unauthorized("Unknown API token.")
    if api_token.revoked_at is not None:
        raise _unauthorized("This API token was revoked.")
    if not api_token.user.is_active:
        raise _unauthorized("This API token's user is deactivated.")
    now = transitions.now()
    expires = api_token.expires_at
    if expires is not None and expires <= now:
        raise _unauthorized(
            f"This API token expired at {expires.isoformat()}; create a new one "
            f"on the API tokens page."
        )
    tokens.touch(api_token, now=now)
    return api_token.user, now


def _unauthorized(detail: str) -> ApiError:
    return ApiError(
        401,
        "unauthorized",
        detail,
        {"WWW-Authenticate": 'Bearer realm="recall", error="invalid_token"'},
    )


# --- Shapes ---------------------------------------------------------------------------


def batch_json(batch: Batch, progress) -> dict:
    """The progress.json object (``requires`` and ``waiting_for_worker``
    included), plus the batch's id, name, creation time and priority."""
    return {
        "id": batch.pk,
        "name": batch.name,
        "created_at": batch.created_at.isoformat(),
        "priority": batch.priority,
        **progress.as_json(),
    }


def _batch_answer(batch: Batch, now: datetime, status: int = 200, **extra: Any):
    batch.refresh_from_db()
    progress = progress_for(batch, now=now, retry=True)
    body = {"batch": batch_json(batch, progress), **extra}
    return JsonResponse(body, status=status)


def item_json(item: BatchItem, job: Job) -> dict:
    return {
        "id": item.pk,
        "source": item.source,
        "params": item.params,
        "state": item.status,
        "attempts": job.attempts,
        "error": job.last_error or None,
        "result": job.result if item.status == ItemStatus.DONE else None,
        # Quality flags of the item's latest completion (batches.flags), sorted.
        "flags": item.flags,
    }


# --- Reading query parameters ------------------------------------------------------


def _only(request: HttpRequest, *names: str) -> None:
    """Refuse query parameters the endpoint does not know (a typo would
    otherwise silently list everything)."""
    unknown = sorted(set(request.GET) - set(names))
    if unknown:
        raise bad_request(
            f"Unknown query parameter(s) {', '.join(repr(u) for u in unknown)}; "
            f"use {', '.join(names)}."
        )


def _cursor(request: HttpRequest) -> int | None:
    value = request.GET.get("cursor")
    if value is None:
        return None
    number = whole_number(value)
    if number is None or number > MAX_DB_ID:
        raise bad_request("'cursor' must be a next_cursor this API returned.")
    return number


def _limit(request: HttpRequest) -> int:
    value = request.GET.get("limit")
    if value is None:
        return PAGE_SIZE
    number = whole_number(value)
    if number is None or not 1 <= number <= PAGE_SIZE:
        raise bad_request(f"'limit' must be a whole number from 1 to {PAGE_SIZE}.")
    return number


def _choice(request: HttpRequest, name: str, choices: tuple[str, ...]) -> str:
    value = request.GET.get(name)
    if value is not None and value not in choices:
        raise bad_request(f"{name!r} must be one of {', '.join(choices)}.")
    return value or ""


def _batch(batch_id: int) -> Batch:
    batch = Batch.objects.filter(pk=batch_id).first() if batch_id <= MAX_DB_ID else None
    if batch is None:
        raise ApiError(404, "not_found", f"There is no batch {batch_id}.")
    return batch


# --- Batches ------------------------------------------------------------------------


@csrf_exempt
def batches(request: HttpRequest) -> HttpResponseBase:
    """``/api/v1/batches``: GET lists, POST submits."""
    if request.method == "GET":
        return batch_list(request)
    if request.method == "POST":
        return batch_create(request)
    return _not_allowed(request, "GET", "POST").response()


@operator_endpoint("GET", READ)
def batch_list(request: HttpRequest, user, *, now: datetime) -> HttpResponse:
    _only(request, "state", "cursor", "limit")
    state = _choice(request, "state", BatchState.ALL)
    cursor, limit = _cursor(request), _limit(request)
    rows: QuerySet[Batch] = Batch.objects.order_by("-pk")
    if state:
        rows = in_state(rows, state, now=now)
    if cursor is not None:
        rows = rows.filter(pk__lt=cursor)
    page = list(rows[: limit + 1])
    more, page = len(page) > limit, page[:limit]
    progress = progress_for_many(page, now=now, retry=True)
    return JsonResponse(
        {
            "batches": [batch_json(b, progress[b.pk]) for b in page],
            "next_cursor": str(page[-1].pk) if more else None,
        }
    )


@operator_endpoint("POST", SUBMIT)
def batch_create(request: HttpRequest, user, *, now: datetime) -> HttpResponse:
    key = request.headers.get("Idempotency-Key")
    if key is not None and not (
        0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS
        and key.isascii()
        and key.isprintable()
    ):
        raise bad_request(
            f"The Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} "
            f"printable ASCII characters."
        )
    body = json_object_body(request)
    unknown = sorted(set(body) - BATCH_FIELDS)
    if unknown:
        raise bad_request(
            f"Unknown field(s) {', '.join(repr(u) for u in unknown)}; a batch has "
            f"{', '.join(repr(f) for f in sorted(BATCH_FIELDS))}."
        )
    name = field(body, "name", str)
    items = field(body, "items", list)
    priority = _int(body, "priority", -32768, 32767, default=0)
    weight: int = _int(body, "weight", 1, MAX_WEIGHT, default=1)
    max_in_flight = _int(body, "max_in_flight", 1, MAX_IN_FLIGHT, default=None)
    try:
        requires = clean_labels(body.get("requires"), what="Field 'requires'")
    except LabelError as error:
        raise bad_request(f"{error}.") from None

    def create() -> Batch:
        return create_batch_from_items(
            name,
            items,
            priority=priority,
            weight=weight,
            max_in_flight=max_in_flight,
            created_by=user,
            now=now,
            requires=requires,
        )

    try:
        if key is None:
            batch, created = create(), True
        else:
            batch, created = submit_once(user, key, body_hash(body), create, now=now)
    except ManifestInvalid as invalid:
        raise bad_request(f"Nothing was created: {invalid}.") from None
    except ItemsInvalid as invalid:
        shown = "; ".join(str(e) for e in invalid.errors[:5])
        more = invalid.total_errors - min(len(invalid.errors), 5)
        raise ApiError(
            400,
            "bad_request",
            f"{invalid.total_errors} problem(s) with the items; nothing was "
            f"created. {shown}"
            + (f"; and {more} more (see 'errors')." if more else "."),
            extra={
                "errors": [
                    {"index": e.index, "message": e.message}
                    for e in invalid.errors[:MAX_REPORTED_ERRORS]
                ],
                "total_errors": invalid.total_errors,
            },
        ) from None
    except IdempotencyConflict as conflict:
        raise ApiError(409, "idempotency_conflict", str(conflict)) from None
    response = _batch_answer(batch, now, status=201 if created else 200)
    response["Location"] = reverse("operator-api-batch", args=[batch.pk])
    return response


def _int(body: dict, name: str, low: int, high: int, *, default: int | None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"Field {name!r} must be a whole number.")
    if not low <= value <= high:
        raise bad_request(f"Field {name!r} must be from {low} to {high}.")
    return value


@operator_endpoint("GET", READ)
def batch_detail(
    request: HttpRequest, user, *, now: datetime, batch_id: int
) -> HttpResponse:
    batch = _batch(batch_id)
    response = JsonResponse(batch_json(batch, progress_for(batch, now=now, retry=True)))
    response["Cache-Control"] = "no-store"
    return response


@operator_endpoint("GET", READ)
def batch_items(
    request: HttpRequest, user, *, now: datetime, batch_id: int
) -> HttpResponse:
    _only(request, "state", "flag", "q", "cursor", "limit")
    batch = _batch(batch_id)
    state = _choice(request, "state", tuple(ItemStatus.values))
    flag = _choice(request, "flag", FLAGS)
    cursor, limit = _cursor(request), _limit(request)
    search = request.GET.get("q")
    # The page's items first, alone (an ordered walk of the (batch, id) index
    # whatever the planner thinks of a just-loaded batch), then their jobs.
    rows = BatchItem.objects.filter(batch=batch)
    words = None
    if search is not None:
        # Words in the transcripts (jobs.search): completed jobs only, in item
        # order like every page, never counted or ranked.
        try:
            words = parse_search(search)
        except BadSearch as bad:
            raise bad_request(f"'q': {bad}") from None
    rows = rows.only("id", "source", "params", "status", *FLAG_COLUMNS.values())
    rows = rows.order_by("pk")
    if state:
        rows = rows.filter(status=state)
    if flag:  # through the flag's partial index on (batch, id)
        rows = rows.filter(**{FLAG_COLUMNS[flag]: True})
    if words is not None:
        # A window of the batch's item ids at a time (jobs.search.in_windows).
        low, high = item_ids(BatchItem.objects.filter(batch=batch)) or (1, 0)
        if cursor is not None:
            low = max(low, cursor + 1)
        with through_the_index():
            page = in_windows(rows, words, limit + 1, low, high)
    else:
        if cursor is not None:
            rows = rows.filter(pk__gt=cursor)
        page = list(rows[: limit + 1])
    more, page = len(page) > limit, page[:limit]
    jobs = {
        job.item_id: job
        for job in Job.objects.filter(item_id__in=[item.pk for item in page]).only(
            "item_id", "attempts", "last_error", "result"
        )
    }
    return JsonResponse(
        {
            "items": [item_json(item, jobs[item.pk]) for item in page],
            "next_cursor": str(page[-1].pk) if more else None,
        }
    )


@operator_endpoint("GET", EXPORT)
def batch_export(
    request: HttpRequest, user, *, now: datetime, batch_id: int, fmt: str
) -> HttpResponseBase:
    if fmt not in EXPORTS:
        raise ApiError(
            404, "not_found", f"No export format {fmt!r}; use csv, jsonl or zip."
        )
    batch = _batch(batch_id)
    response = export_response(batch, fmt)
    if response is None:
        raise ApiError(
            503,
            "unavailable",
            f"This server already streams {settings.RECALL_EXPORTS_PER_PROCESS} "
            f"exports; retry in a little while.",
            {"Retry-After": "30"},
        )
    return response


# --- Actions ------------------------------------------------------------------------


@operator_endpoint("POST", OPERATE)
def batch_pause(
    request: HttpRequest, user, *, now: datetime, batch_id: int
) -> HttpResponse:
    json_object_body(request)
    batch = _batch(batch_id)
    changed = transitions.pause_batch(batch, actor=user, now=now)
    return _batch_answer(batch, now, changed=changed)


@operator_endpoint("POST", OPERATE)
def batch_resume(
    request: HttpRequest, user, *, now: datetime, batch_id: int
) -> HttpResponse:
    json_object_body(request)
    batch = _batch(batch_id)
    changed = transitions.resume_batch(batch, actor=user, now=now)
    return _batch_answer(batch, now, changed=changed)


@operator_endpoint("POST", OPERATE)
def batch_cancel(
    request: HttpRequest, user, *, now: datetime, batch_id: int
) -> HttpResponse:
    json_object_body(request)
    batch = _batch(batch_id)
    if batch.cancelled_at:
        return _batch_answer(batch, now, changed=False, cancelled=0)
    cancelled = transitions.cancel_batch(
        batch, actor=user, now=now, time_limit=ACTION_SECONDS
    )
    return _batch_answer(batch, now, changed=True, cancelled=cancelled)


@operator_endpoint("POST", OPERATE)
def batch_retry(
    request: HttpRequest, user, *, now: datetime, batch_id: int
) -> HttpResponse:
    body = json_object_body(request)
    # A misspelt filter must not retry every failed item.
    unknown = sorted(set(body) - {"source_contains"})
    if unknown:
        raise bad_request(
            f"Unknown field(s) {', '.join(repr(u) for u in unknown)}; a retry "
            f"takes only 'source_contains'."
        )
    search = field(body, "source_contains", str, required=False, default="")
    # As the schema says: the value sent, spaces around it included.
    if len(search) > MAX_SEARCH_CHARS:
        raise bad_request(
            f"Field 'source_contains' must be at most {MAX_SEARCH_CHARS} characters."
        )
    search = search.strip()
    batch = _batch(batch_id)
    if batch.cancelled_at:
        raise ApiError(
            409,
            "invalid_transition",
            f"Batch {batch.pk} is cancelled: it cannot be retried.",
        )
    jobs = Job.objects.filter(batch=batch)
    if search:
        jobs = jobs.filter(item__source__icontains=search)
    queued = transitions.retry_failed(jobs, actor=user, now=now)
    return _batch_answer(batch, now, changed=queued > 0, queued=queued)


@operator_endpoint("POST", CHANGE)
def batch_rerun(
    request: HttpRequest, user, *, now: datetime, batch_id: int
) -> HttpResponse:
    """Re-run chosen items (``{"items": [ids]}``) or every done item with a
    quality flag (``{"flag": "short"}``), optionally requiring worker labels
    of the new run (``"requires"``): ``{"rerun": N}``. Only done and failed
    items re-run; naming any other refuses the whole request (409, or 404
    for ids that are not the batch's items), nothing written."""
    body = json_object_body(request)
    unknown = sorted(set(body) - RERUN_FIELDS)
    if unknown:
        raise bad_request(
            f"Unknown field(s) {', '.join(repr(u) for u in unknown)}; a re-run "
            f"takes 'items' or 'flag', and optionally 'requires'."
        )
    items, flag = body.get("items"), body.get("flag")
    if (items is None) == (flag is None):
        raise bad_request(
            "Send either 'items' (a list of item ids) or 'flag' (one of "
            f"{', '.join(FLAGS)}), not both and not neither."
        )
    if items is not None:
        items = _item_ids(items)
    if flag is not None and flag not in FLAGS:
        raise bad_request(f"Field 'flag' must be one of {', '.join(FLAGS)}.")
    try:
        requires = clean_labels(body.get("requires"), what="Field 'requires'")
    except LabelError as error:
        raise bad_request(f"{error}.") from None
    batch = _batch(batch_id)
    try:
        n = transitions.rerun(
            batch, items=items, flag=flag, requires=requires, actor=user, now=now
        )
    except BatchClosed:
        raise ApiError(
            409,
            "invalid_transition",
            f"Batch {batch.pk} is cancelled: its items cannot be re-run.",
        ) from None
    except LabelError as error:
        raise bad_request(f"Field 'requires': {error}.") from None
    except RerunRefused as refused:
        raise ApiError(
            404 if refused.missing else 409,
            "not_found" if refused.missing else "not_rerunnable",
            str(refused),
            extra={
                "missing": refused.missing,
                "not_rerunnable": [
                    {"id": item_id, "state": state}
                    for item_id, state in refused.busy.items()
                ],
            },
        ) from None
    return JsonResponse({"rerun": n})


def _item_ids(value: object) -> list[int]:
    """A re-run's ``items``: 1 to MAX_RERUN_ITEMS item ids (whole numbers)."""
    if not isinstance(value, list) or not value:
        raise bad_request("Field 'items' must be a non-empty list of item ids.")
    if len(value) > MAX_RERUN_ITEMS:
        raise bad_request(
            f"Field 'items' names at most {MAX_RERUN_ITEMS} items; re-run more "
            f"in several requests, or by 'flag'."
        )
    for each in value:
        if isinstance(each, bool) or not isinstance(each, int):
            raise bad_request("Field 'items' must hold item ids (whole numbers).")
        if not 1 <= each <= MAX_DB_ID:
            raise bad_request(f"Field 'items': {each} is not an item id.")
    return list(value)
