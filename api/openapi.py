"""OpenAPI 3 description of Recall's API v1, served at /api/v1/openapi.json: the
worker API's (``api.worker_openapi``, tag ``worker``) and the operator API's paths
(tag ``operator``) in one document.

Like the worker API's, it is the contract the operator API is fuzzed against
(tests/jobs/test_api_fuzz.py): no request may get an undocumented answer.
"""

from __future__ import annotations

import copy
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from api import worker_openapi
from api.operator_views import MAX_RERUN_ITEMS, MAX_SEARCH_CHARS, PAGE_SIZE
from batches.flags import FLAGS
from batches.labels import KEY, MAX_LABELS, VALUE
from batches.models import MAX_IN_FLIGHT, MAX_WEIGHT, ItemStatus
from engine.progress import BatchState
from jobs.search import MAX_SEARCH_CHARS as MAX_QUERY_CHARS
from jobs.search import MAX_SEARCH_WORDS
from operator_api.models import MAX_IDEMPOTENCY_KEY_CHARS

SECURITY: list[dict[str, list[str]]] = [{"apiToken": []}]


def _error(description: str) -> dict:
    return worker_openapi._error(description)


ERRORS = {
    "401": _error("Missing, unknown or revoked API token (or a worker token)."),
    "403": _error("The token's user lacks the permission this needs."),
    "503": _error("The database is unavailable; retry with backoff."),
}
BATCH_ERRORS = {**ERRORS, "404": _error("No such batch.")}
POST_ERRORS = {
    **BATCH_ERRORS,
    "400": _error(
        f"Malformed JSON, not an object, an ill-typed field, NUL bytes, nested "
        f"more than {worker_openapi.MAX_JSON_DEPTH} levels deep."
    ),
    "413": _error("The body is larger than the configured limit."),
}
BATCH_ID = {
    "name": "batch_id",
    "in": "path",
    "required": True,
    "schema": {"type": "integer", "minimum": 0},
}
CURSOR = {
    "name": "cursor",
    "in": "query",
    "required": False,
    "description": "The next_cursor of the previous page.",
    "schema": {"type": "string", "pattern": "^[0-9]{1,19}$"},
}
LIMIT = {
    "name": "limit",
    "in": "query",
    "required": False,
    "schema": {"type": "integer", "minimum": 1, "maximum": PAGE_SIZE},
}


def _json(schema: str, description: str = "OK") -> dict:
    return worker_openapi._json(schema, description)


def _ref(schema: str) -> dict:
    return {"$ref": f"#/components/schemas/{schema}"}


def _action(name: str, summary: str, body: str | None = None) -> dict:
    operation: dict = {
        "operationId": f"{name}_batch",
        "tags": ["operator"],
        "security": SECURITY,
        "summary": summary,
        "parameters": [BATCH_ID],
        "responses": {"200": _json("BatchAction"), **POST_ERRORS},
    }
    if body:
        operation["requestBody"] = {
            "required": False,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    else:
        operation["requestBody"] = {
            "required": False,
            "content": {
                "application/json": {
                    "schema": {"type": "object", "description": "Empty."}
                }
            },
        }
    return {"post": operation}


def _export(fmt: str, content_type: str, what: str) -> dict:
    return {
        "get": {
            "operationId": f"export_{fmt}",
            "tags": ["operator"],
            "security": SECURITY,
            "summary": f"Stream the batch's {what} (as the UI's export).",
            "parameters": [BATCH_ID],
            "responses": {
                "200": {
                    "description": what,
                    "content": {
                        content_type: {"schema": {"type": "string", "format": "binary"}}
                    },
                },
                **BATCH_ERRORS,
                "503": _error(
                    "This process already streams RECALL_EXPORTS_PER_PROCESS "
                    "exports (retry after Retry-After seconds), or the database is "
                    "unavailable."
                ),
            },
        }
    }


PATHS = {
    "/api/v1/batches": {
        "get": {
            "operationId": "list_batches",
            "tags": ["operator"],
            "security": SECURITY,
            "summary": "Batches, newest first, in pages (keyset: next_cursor).",
            "parameters": [
                {
                    "name": "state",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string", "enum": list(BatchState.ALL)},
                },
                CURSOR,
                LIMIT,
            ],
            "responses": {
                "200": _json("BatchPage"),
                **ERRORS,
                "400": _error("A bad state, cursor or limit."),
            },
        },
        "post": {
            "operationId": "submit_batch",
            "tags": ["operator"],
            "security": SECURITY,
            "summary": "Submit a batch; idempotent with an Idempotency-Key.",
            "parameters": [
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": False,
                    "description": "The same key from the same user within 24 h "
                    "returns the batch it created (200) instead of a new one.",
                    "schema": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": MAX_IDEMPOTENCY_KEY_CHARS,
                    },
                }
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref("SubmitRequest")}},
            },
            "responses": {
                "201": {
                    **_json("BatchCreated", "Created."),
                    "headers": {
                        "Location": {
                            "description": "The batch's URL in this API.",
                            "schema": {"type": "string"},
                        }
                    },
                },
                "200": _json(
                    "BatchCreated", "The batch this Idempotency-Key already made."
                ),
                **POST_ERRORS,
                "400": {
                    "description": "Invalid fields or items: every bad item listed "
                    "in 'errors' by index; nothing was created.",
                    "content": {"application/json": {"schema": _ref("SubmitError")}},
                },
                "409": _error("idempotency_conflict: the key went with another body."),
            },
        },
    },
    "/api/v1/batches/{batch_id}": {
        "get": {
            "operationId": "get_batch",
            "tags": ["operator"],
            "security": SECURITY,
            "summary": "The batch's progress (progress.json, plus id and name).",
            "parameters": [BATCH_ID],
            "responses": {"200": _json("Batch"), **BATCH_ERRORS},
        }
    },
    "/api/v1/batches/{batch_id}/items": {
        "get": {
            "operationId": "list_items",
            "tags": ["operator"],
            "security": SECURITY,
            "summary": "The batch's items in id order, in pages (keyset).",
            "parameters": [
                BATCH_ID,
                {
                    "name": "state",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string", "enum": list(ItemStatus.values)},
                },
                {
                    "name": "flag",
                    "in": "query",
                    "required": False,
                    "description": "Only the items with this quality flag.",
                    "schema": {"type": "string", "enum": list(FLAGS)},
                },
                {
                    "name": "q",
                    "in": "query",
                    "required": False,
                    "description": (
                        "Only the done items whose transcript (the result's "
                        "text) holds every word of this search, ignoring case. "
                        "On PostgreSQL a full-text match of whole words (the "
                        "'simple' configuration: no stemming, no stop words; "
                        "the first 100,000 characters of each transcript); on "
                        "SQLite each word as a substring. Combines with the "
                        "other filters and the cursor; pages are in id order, "
                        f"never counted or ranked. At most {MAX_QUERY_CHARS} "
                        f"characters and {MAX_SEARCH_WORDS} words."
                    ),
                    "schema": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": MAX_QUERY_CHARS,
                    },
                },
                CURSOR,
                LIMIT,
            ],
            "responses": {
                "200": _json("ItemPage"),
                **BATCH_ERRORS,
                "400": _error(
                    "A bad state, flag, cursor or limit; a search (q) that is "
                    "empty, too long, has too many words or none."
                ),
            },
        }
    },
    "/api/v1/batches/{batch_id}/export.csv": _export(
        "csv", "text/csv", "CSV of every item"
    ),
    "/api/v1/batches/{batch_id}/export.jsonl": _export(
        "jsonl", "application/x-ndjson", "JSON Lines of every item"
    ),
    "/api/v1/batches/{batch_id}/export.zip": _export(
        "zip", "application/zip", "ZIP of transcripts (.txt and .srt)"
    ),
    "/api/v1/batches/{batch_id}/pause": _action(
        "pause", "Hand out no new work; leases in flight finish."
    ),
    "/api/v1/batches/{batch_id}/resume": _action("resume", "Hand out work again."),
    "/api/v1/batches/{batch_id}/cancel": _action(
        "cancel", "Cancel queued and in-flight items; finished ones keep results."
    ),
    "/api/v1/batches/{batch_id}/retry": {
        "post": {
            **_action(
                "retry",
                "Queue the failed items again (those whose source contains "
                "source_contains, if given), with fresh attempts.",
                "RetryRequest",
            )["post"],
            "responses": {
                "200": _json("BatchAction"),
                **POST_ERRORS,
                "409": _error("invalid_transition: the batch is cancelled."),
            },
        }
    },
    "/api/v1/batches/{batch_id}/rerun": {
        "post": {
            "operationId": "rerun_batch_items",
            "tags": ["operator"],
            "security": SECURITY,
            "summary": (
                "Re-run chosen done or failed items (items), or every done item "
                "with a quality flag (flag), as a new run: back to queued with "
                "fresh attempts, the previous result kept in the item's history, "
                "optionally requiring worker labels of the new run on top of the "
                "batch's (requires). A finished batch runs and finishes again. "
                "Needs batches.change_batch."
            ),
            "parameters": [BATCH_ID],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref("RerunRequest")}},
            },
            "responses": {
                "200": _json("RerunAnswer"),
                **POST_ERRORS,
                "400": _error(
                    "Neither or both of items and flag, an unknown field, ids that "
                    "are not whole numbers, more than "
                    f"{MAX_RERUN_ITEMS} of them, an unknown flag, requires that "
                    "break the label rules or give a key the batch requires "
                    "another value; or malformed JSON."
                ),
                "404": {
                    "description": "No such batch, or items that are not its "
                    "(listed in missing); nothing was re-run.",
                    "content": {"application/json": {"schema": _ref("RerunRefused")}},
                },
                "409": {
                    "description": "not_rerunnable: named items are queued, in "
                    "flight or cancelled (listed in not_rerunnable), nothing was "
                    "re-run; or invalid_transition: the batch is cancelled.",
                    "content": {"application/json": {"schema": _ref("RerunRefused")}},
                },
            },
        }
    },
}

COUNTS = {
    "type": "object",
    "additionalProperties": False,
    "required": list(ItemStatus.values),
    "properties": {s: {"type": "integer", "minimum": 0} for s in ItemStatus.values},
}
# What a batch requires of workers (``batches.labels``): keys match
# KEY.pattern (OpenAPI 3.0 cannot say so of property names), values VALUE's.
REQUIRES_TEXT = (
    f"Worker labels a worker must declare, each key with exactly this value, to "
    f"claim the batch's jobs; {{}} lets any worker claim them. Keys match "
    f"^{KEY.pattern}$, at most {MAX_LABELS} labels."
)
REQUIRES: dict[str, Any] = {
    "type": "object",
    "maxProperties": MAX_LABELS,
    "additionalProperties": {
        "type": "string",
        "minLength": 1,
        "maxLength": 63,
        "pattern": f"^{VALUE.pattern}$",
    },
    "description": REQUIRES_TEXT,
    "example": {"gpu": "a100", "model": "large-v3"},
}
BATCH = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "id",
        "name",
        "created_at",
        "priority",
        "batch",
        "state",
        "total",
        "counts",
        "percent_done",
        "throughput_per_minute",
        "eta_seconds",
        "weight",
        "max_in_flight",
        "in_flight",
        "silent",
        "retry",
        "requires",
        "waiting_for_worker",
        "flags",
    ],
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "created_at": {"type": "string", "format": "date-time"},
        "priority": {"type": "integer"},
        "batch": {"type": "integer", "description": "The id again (progress.json)."},
        "state": {"type": "string", "enum": list(BatchState.ALL)},
        "total": {"type": "integer", "minimum": 0},
        "counts": COUNTS,
        "percent_done": {"type": "number", "minimum": 0, "maximum": 100},
        "throughput_per_minute": {"type": "number", "nullable": True},
        "eta_seconds": {
            "type": "integer",
            "nullable": True,
            "description": "Seconds until done at the recent rate; null when "
            "unknown (no recent throughput, paused, cancelled, or "
            "waiting_for_worker).",
        },
        "weight": {"type": "integer", "minimum": 1, "maximum": MAX_WEIGHT},
        "max_in_flight": {"type": "integer", "nullable": True},
        "in_flight": {"type": "integer", "minimum": 0},
        "silent": {
            "type": "integer",
            "minimum": 0,
            "description": "Of in_flight, the leases whose worker has not "
            "heartbeated for two heartbeat intervals (nobody is known to be "
            "working on them; they stay live until they expire or heartbeat).",
        },
        "retry": {
            "type": "object",
            "nullable": True,
            "additionalProperties": False,
            "required": ["waiting", "in_seconds"],
            "properties": {
                "waiting": {"type": "integer", "minimum": 1},
                "in_seconds": {"type": "integer", "minimum": 0},
            },
            "description": "Set when no queued item can be claimed yet because "
            "each waits out the backoff after a retryable failure: how many, "
            "and seconds until the first may be claimed. Null otherwise.",
        },
        "requires": REQUIRES,
        "waiting_for_worker": {
            "type": "boolean",
            "description": "True when the batch is open with queued items and no "
            "active worker whose labels satisfy 'requires' has claimed or polled "
            "within the workers page's online window (the lease length plus 60 "
            "s): nobody can take its work. Its eta_seconds is then null.",
        },
        "flags": {
            "type": "object",
            "additionalProperties": False,
            "required": list(FLAGS),
            "properties": {flag: {"type": "integer", "minimum": 0} for flag in FLAGS},
            "description": "Done items per quality flag (empty, short, "
            "language_mismatch).",
        },
    },
}
ITEM = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "id",
        "source",
        "params",
        "state",
        "attempts",
        "error",
        "result",
        "flags",
    ],
    "properties": {
        "id": {"type": "integer"},
        "source": {"type": "string"},
        "params": {"type": "object"},
        "state": {"type": "string", "enum": list(ItemStatus.values)},
        "attempts": {"type": "integer", "minimum": 0},
        "error": {"type": "string", "nullable": True},
        "result": {
            "type": "object",
            "nullable": True,
            "description": "The stored transcript, when the item is done.",
        },
        "flags": {
            "type": "array",
            "items": {"type": "string", "enum": list(FLAGS)},
            "description": "Quality flags of the item's latest completion, "
            "sorted ([] when none or not done).",
        },
    },
}
NEXT_CURSOR = {"type": "string", "nullable": True}

SCHEMAS = {
    "Batch": BATCH,
    "BatchCreated": {
        "type": "object",
        "additionalProperties": False,
        "required": ["batch"],
        "properties": {"batch": _ref("Batch")},
    },
    "BatchAction": {
        "type": "object",
        "additionalProperties": False,
        "required": ["batch", "changed"],
        "properties": {
            "batch": _ref("Batch"),
            "changed": {"type": "boolean"},
            "cancelled": {"type": "integer", "minimum": 0},
            "queued": {"type": "integer", "minimum": 0},
        },
    },
    "BatchPage": {
        "type": "object",
        "additionalProperties": False,
        "required": ["batches", "next_cursor"],
        "properties": {
            "batches": {"type": "array", "items": _ref("Batch")},
            "next_cursor": NEXT_CURSOR,
        },
    },
    "Item": ITEM,
    "ItemPage": {
        "type": "object",
        "additionalProperties": False,
        "required": ["items", "next_cursor"],
        "properties": {
            "items": {"type": "array", "items": _ref("Item")},
            "next_cursor": NEXT_CURSOR,
        },
    },
    "SubmitRequest": {
        "type": "object",
        "required": ["name", "items"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 200},
            "priority": {
                "type": "integer",
                "minimum": -32768,
                "maximum": 32767,
                "nullable": True,
                "description": "Default 0.",
            },
            "weight": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_WEIGHT,
                "nullable": True,
                "description": "Default 1.",
            },
            "max_in_flight": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_IN_FLIGHT,
                "nullable": True,
            },
            "requires": {
                **REQUIRES,
                "nullable": True,
                "description": REQUIRES_TEXT + " Default {}; anything "
                "else that breaks these rules is 400 bad_request.",
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["source"],
                    "additionalProperties": False,
                    "properties": {
                        "source": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 4096,
                            "description": "A path or URL (RECALL_SOURCE_SCHEMES).",
                        },
                        "duration_seconds": {
                            "type": "number",
                            "minimum": 0,
                            "maximum": 10_000_000,
                            "nullable": True,
                        },
                        "params": {
                            "type": "object",
                            "nullable": True,
                            "additionalProperties": {
                                "oneOf": [
                                    {"type": "string", "maxLength": 10_000},
                                    {"type": "number"},
                                    {"type": "boolean"},
                                ]
                            },
                        },
                    },
                },
            },
        },
    },
    "SubmitError": {
        "type": "object",
        "required": ["error", "detail"],
        "additionalProperties": False,
        "properties": {
            "error": {"type": "string", "enum": ["bad_request"]},
            "detail": {"type": "string", "minLength": 1},
            "errors": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message"],
                    "properties": {
                        "index": {"type": "integer", "nullable": True},
                        "message": {"type": "string"},
                    },
                },
            },
            "total_errors": {"type": "integer", "minimum": 1},
        },
    },
    "RerunRequest": {
        "type": "object",
        "additionalProperties": False,
        "description": "Exactly one of items and flag.",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_RERUN_ITEMS,
                "items": {"type": "integer", "minimum": 1},
                "description": "Ids of the batch's items, each done or failed.",
            },
            "flag": {
                "type": "string",
                "enum": list(FLAGS),
                "description": "Every done item of the batch with this flag.",
            },
            "requires": {
                **REQUIRES,
                "nullable": True,
                "description": "Worker labels the new run needs on top of the "
                "batch's (the same rules); {} or absent: the batch's alone.",
            },
        },
    },
    "RerunAnswer": {
        "type": "object",
        "required": ["rerun"],
        "additionalProperties": False,
        "properties": {
            "rerun": {
                "type": "integer",
                "minimum": 0,
                "description": "How many items were queued again as a new run.",
            }
        },
    },
    "RerunRefused": {
        "type": "object",
        "required": ["error", "detail"],
        "properties": {
            "error": {
                "type": "string",
                "enum": ["not_found", "not_rerunnable", "invalid_transition"],
            },
            "detail": {"type": "string"},
            "missing": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "Named ids that are not items of the batch.",
            },
            "not_rerunnable": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "state"],
                    "properties": {
                        "id": {"type": "integer"},
                        "state": {"type": "string", "enum": list(ItemStatus.values)},
                    },
                },
                "description": "Named items that are not done or failed, with "
                "their state.",
            },
        },
    },
    "RetryRequest": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "source_contains": {"type": "string", "maxLength": MAX_SEARCH_CHARS}
        },
    },
}


def _spec() -> dict:
    spec: dict[str, Any] = copy.deepcopy(worker_openapi.SPEC)
    spec["info"] = {
        "title": "Recall API",
        "version": "1",
        "description": (
            "Worker API (tag worker): workers claim a job under a time-limited "
            "lease, heartbeat every heartbeat_interval seconds, then complete, "
            "fail or release it; every call needs 'Authorization: Bearer <worker "
            "token>'. Operator API (tag operator): pipelines submit batches, "
            "follow them and fetch results; every call needs 'Authorization: "
            "Bearer <API token>' (a user's personal token, with that user's "
            "permissions). Neither kind of token is accepted by the other API. "
            + worker_openapi.BODY_RULES
        ),
    }
    spec["tags"] = [
        *spec["tags"],
        {"name": "operator", "description": "For pipelines and operators."},
    ]
    spec["paths"].update(copy.deepcopy(PATHS))
    components = spec["components"]
    components["securitySchemes"]["apiToken"] = {"type": "http", "scheme": "bearer"}
    components["schemas"]["Error"]["properties"]["error"]["enum"] += [
        "idempotency_conflict",
        "invalid_transition",
    ]
    components["schemas"].update(copy.deepcopy(SCHEMAS))
    return spec


SPEC = _spec()


@require_GET
def openapi(request: HttpRequest) -> JsonResponse:
    """The description itself is public: it holds no data."""
    return JsonResponse(SPEC)
