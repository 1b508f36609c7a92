"""OpenAPI 3 description of the worker API v1 (tag ``worker``). Served at
/api/v1/openapi.json together with the operator API's (``api.openapi``
adds its paths, tagged ``operator``).

It is the contract the API is fuzzed against (tests/jobs/test_api_fuzz.py):
every documented response is the only kind of response a request can get.
"""

from __future__ import annotations

from batches.json_limits import MAX_JSON_DEPTH
from jobs.transitions.rules import (
    COMPLETED,
    LEASE_LOST,
    MAX_COMPLETIONS,
    MAX_HEARTBEAT_LEASES,
    NOT_FOUND,
)

# What every JSON body must be, whatever its schema says.
BODY_RULES = (
    f"Bodies are JSON objects nesting arrays and objects at most {MAX_JSON_DEPTH} "
    f"levels deep (the body itself is level 1), without NUL characters, unpaired "
    f"surrogates, NaN, infinite numbers (1e400) or integers of more than 4300 "
    f"digits; anything else is a 400 bad_request."
)

ERROR_CODES = [
    "bad_request",
    "unauthorized",
    "forbidden",
    "not_found",
    "method_not_allowed",
    "lease_lost",
    "payload_too_large",
    "too_many_leases",
    "rate_limited",
    "unavailable",
    "internal_error",
]


def _error(description: str) -> dict:
    return {
        "description": description,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
        },
    }


def _json(schema_ref: str, description: str = "OK") -> dict:
    return {
        "description": description,
        "content": {
            "application/json": {
                "schema": {"$ref": f"#/components/schemas/{schema_ref}"}
            }
        },
    }


RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "schema": {"type": "integer", "minimum": 1},
    }
}


def _too_many(description: str) -> dict:
    return {**_error(description), "headers": RETRY_AFTER}


RATE_LIMITED = (
    "rate_limited: the worker sent more than RECALL_WORKER_RATE_PER_SECOND "
    "requests a second (in bursts of up to RECALL_WORKER_RATE_BURST), counted by "
    "the whole server; retry after Retry-After seconds."
)
ERRORS = {
    "400": _error(
        f"Malformed JSON, not an object, a missing or ill-typed field, NUL bytes, "
        f"nested more than {MAX_JSON_DEPTH} levels deep, a number out of range."
    ),
    "401": _error("Missing or unknown worker token."),
    "403": _error("The worker is disabled."),
    "413": _error("The body is larger than the configured limit."),
    "429": _too_many(RATE_LIMITED),
    "503": _error("The database is unavailable; retry with backoff."),
}
JOB_ERRORS = {
    **ERRORS,
    "404": _error("No such job."),
    "409": _error("The caller does not hold the job's live lease: stop working on it."),
}
JOB_ID = {
    "name": "job_id",
    "in": "path",
    "required": True,
    "schema": {"type": "integer", "minimum": 0},
}
TOKEN = {"type": "string", "minLength": 1, "maxLength": 256}


def _body(schema_ref: str) -> dict:
    return {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"$ref": f"#/components/schemas/{schema_ref}"}
            }
        },
    }


SPEC = {
    "openapi": "3.0.3",
    "info": {
        "title": "Recall worker API",
        "version": "1",
        "description": (
            "Workers claim a job under a time-limited lease, heartbeat every "
            "heartbeat_interval seconds (one call for all of a worker's leases: "
            "/api/v1/heartbeat), then complete, fail or release it. Every "
            "call needs 'Authorization: Bearer <worker token>'. " + BODY_RULES
        ),
    },
    "tags": [{"name": "worker", "description": "For transcription workers."}],
    "servers": [{"url": "/"}],
    "security": [{"workerToken": []}],
    "paths": {
        "/api/v1/claim": {
            "post": {
                "operationId": "claim",
                "tags": ["worker"],
                "summary": (
                    "Lease the next claimable job (or up to max_jobs of them) "
                    "the worker's labels can serve."
                ),
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/ClaimRequest"}
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": (
                            "A job leased to the caller (Claimed), or, with "
                            "max_jobs, 1 to max_jobs of them (ClaimedMany)."
                        ),
                        "content": {
                            "application/json": {
                                "schema": {
                                    "oneOf": [
                                        {"$ref": "#/components/schemas/Claimed"},
                                        {"$ref": "#/components/schemas/ClaimedMany"},
                                    ]
                                }
                            }
                        },
                    },
                    "204": {
                        "description": (
                            "Nothing is claimable now (or within wait_seconds); "
                            "claim again later."
                        )
                    },
                    **ERRORS,
                    "429": _too_many(
                        "too_many_leases: the worker already holds RECALL_MAX_LEASES_PER_WORKER live leases; or "
                        + RATE_LIMITED
                    ),
                },
            }
        },
        "/api/v1/jobs/{job_id}/heartbeat": {
            "post": {
                "operationId": "heartbeat",
                "tags": ["worker"],
                "summary": "Extend the lease.",
                "parameters": [JOB_ID],
                "requestBody": _body("LeaseRequest"),
                "responses": {"200": _json("Heartbeat"), **JOB_ERRORS},
            }
        },
        "/api/v1/jobs/{job_id}/complete": {
            "post": {
                "operationId": "complete",
                "tags": ["worker"],
                "summary": "Store the result; idempotent for the token that completed it.",
                "parameters": [JOB_ID],
                "requestBody": _body("CompleteRequest"),
                "responses": {"200": _json("Status"), **JOB_ERRORS},
            }
        },
        "/api/v1/jobs/{job_id}/fail": {
            "post": {
                "operationId": "fail",
                "tags": ["worker"],
                "summary": "Record a failed attempt (retried later if retryable and attempts remain).",
                "parameters": [JOB_ID],
                "requestBody": _body("FailRequest"),
                "responses": {"200": _json("Status"), **JOB_ERRORS},
            }
        },
        "/api/v1/jobs/{job_id}/release": {
            "post": {
                "operationId": "release",
                "tags": ["worker"],
                "summary": "Give the job back at once (clean shutdown); the attempt is not counted.",
                "parameters": [JOB_ID],
                "requestBody": _body("LeaseRequest"),
                "responses": {"200": _json("Status"), **JOB_ERRORS},
            }
        },
        "/api/v1/heartbeat": {
            "post": {
                "operationId": "heartbeat_many",
                "tags": ["worker"],
                "summary": "Extend many leases at once (a worker with several GPUs).",
                "description": (
                    "One call for all of the worker's leases, renewed in one "
                    "transaction. Each lease is judged alone, exactly as the "
                    "single heartbeat judges it, and answered in the order "
                    "asked: its new expiry, or lease_lost (not this worker's "
                    "live lease under that token: stop working on it) or "
                    "not_found (no such job). A lost lease never stops the "
                    "others being renewed. A server older than this call "
                    "answers 400 or 404: heartbeat each lease alone then."
                ),
                "requestBody": _body("HeartbeatManyRequest"),
                "responses": {
                    "200": _json("HeartbeatMany", "One answer per lease, in order."),
                    **ERRORS,
                },
            }
        },
        "/api/v1/complete": {
            "post": {
                "operationId": "complete_many",
                "tags": ["worker"],
                "summary": "Complete many jobs at once (a worker with several GPUs).",
                "description": (
                    "Several results in one call, made in one transaction on "
                    "the server. Each is judged alone, exactly as the single "
                    "completion judges it, and answered in the order sent: "
                    "completed (also for a replay with the token that "
                    "completed it: the worker may have lost an earlier "
                    "answer), or lease_lost (not this worker's live lease "
                    "under that token: the result was not stored) or "
                    "not_found (no such job). A lost lease never stops the "
                    "others being completed. The body's size limit is the "
                    "single completion's, for the whole call. A server older "
                    "than this call answers 400 or 404: complete each job "
                    "alone then."
                ),
                "requestBody": _body("CompleteManyRequest"),
                "responses": {
                    "200": _json("CompleteMany", "One answer per result, in order."),
                    **ERRORS,
                },
            }
        },
    },
    "components": {
        "securitySchemes": {"workerToken": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error", "detail"],
                "additionalProperties": False,
                "properties": {
                    "error": {"type": "string", "enum": ERROR_CODES},
                    "detail": {"type": "string", "minLength": 1},
                },
            },
            "ClaimRequest": {
                "type": "object",
                "description": (
                    "Empty, or how long to wait for work, the worker's labels and "
                    "how many jobs to take at most; unknown fields are ignored."
                ),
                "properties": {
                    "labels": {
                        "type": "object",
                        "maxProperties": 16,
                        "additionalProperties": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 63,
                            "pattern": "^[A-Za-z0-9_.:/-]{1,63}$",
                        },
                        "example": {"gpu": "a100", "model": "large-v3"},
                        "description": (
                            "The labels this worker offers (at most 16; keys match "
                            "^[a-z0-9][a-z0-9_.-]{0,62}$, values are 1 to 63 "
                            "characters of A-Za-z0-9_.:/-; anything else is 400). "
                            "The claim takes only jobs of batches whose every "
                            "required label the worker has with exactly that "
                            "value (a batch that requires nothing is open to "
                            "all); priority, weights and max_in_flight decide "
                            "among those. Absent declares none. The "
                            "server keeps the labels of the worker's latest "
                            "claim; a waiting claim is woken only by work its "
                            "labels can take."
                        ),
                    },
                    "max_jobs": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": 32,
                        "description": (
                            "Take up to this many jobs in one call: the answer "
                            'is then {"jobs": [...]} (ClaimedMany) with 1 to '
                            "max_jobs jobs, shared out among batches as that "
                            "many single claims in a row would share them, "
                            "never more than the worker's lease cap leaves room "
                            "for (429 only when it is at the cap already), or "
                            "204 when none. With wait_seconds, the wait ends as "
                            "soon as at least one job is leased. Without it, a "
                            'claim answers {"job": {...}} (Claimed).'
                        ),
                    },
                    "wait_seconds": {
                        "type": "number",
                        "minimum": 0,
                        "maximum": 60,
                        "default": 0,
                        "description": (
                            "When nothing is claimable, hold the request until "
                            "a job is or this many seconds have passed, then "
                            "answer 200 or 204 (a long-poll). 0 answers at once, "
                            "and so does a claim of a worker that has "
                            "RECALL_MAX_WAITING_CLAIMS_PER_WORKER claims waiting "
                            "already."
                        ),
                    },
                },
            },
            "Claimed": {
                "type": "object",
                "description": "The answer to a claim without max_jobs.",
                "required": ["job"],
                "additionalProperties": False,
                "properties": {"job": {"$ref": "#/components/schemas/LeasedJob"}},
            },
            "ClaimedMany": {
                "type": "object",
                "description": (
                    "The answer to a claim with max_jobs: 1 to max_jobs jobs, each "
                    "exactly what a single claim answers (its own lease token and "
                    "expiry)."
                ),
                "required": ["jobs"],
                "additionalProperties": False,
                "properties": {
                    "jobs": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 32,
                        "items": {"$ref": "#/components/schemas/LeasedJob"},
                    }
                },
            },
            "LeasedJob": {
                "type": "object",
                "additionalProperties": False,
                "required": [
                    "id",
                    "lease_token",
                    "lease_expires_at",
                    "lease_seconds",
                    "heartbeat_interval",
                    "attempt",
                    "max_attempts",
                    "batch",
                    "item",
                ],
                "properties": {
                    "id": {"type": "integer"},
                    "lease_token": {"type": "string"},
                    "lease_expires_at": {
                        "type": "string",
                        "format": "date-time",
                    },
                    "lease_seconds": {"type": "integer", "minimum": 1},
                    "heartbeat_interval": {"type": "integer", "minimum": 1},
                    "attempt": {"type": "integer", "minimum": 1},
                    "max_attempts": {"type": "integer", "minimum": 1},
                    "batch": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["id", "name"],
                        "properties": {
                            "id": {"type": "integer"},
                            "name": {"type": "string"},
                        },
                    },
                    "item": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": [
                            "id",
                            "source",
                            "params",
                            "duration_seconds",
                        ],
                        "properties": {
                            "id": {"type": "integer"},
                            "source": {"type": "string"},
                            "params": {"type": "object"},
                            "duration_seconds": {
                                "type": "number",
                                "nullable": True,
                            },
                        },
                    },
                },
            },
            "LeaseRequest": {
                "type": "object",
                "required": ["lease_token"],
                "properties": {"lease_token": TOKEN},
            },
            "CompleteRequest": {
                "type": "object",
                "required": ["lease_token", "result"],
                "properties": {
                    "lease_token": TOKEN,
                    "result": {"$ref": "#/components/schemas/Result"},
                },
            },
            "Result": {
                "type": "object",
                "required": ["text"],
                "properties": {
                    "text": {"type": "string"},
                    "language": {"type": "string"},
                    "segments": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["start", "end", "text"],
                            "properties": {
                                "start": {
                                    "type": "number",
                                    "minimum": 0,
                                    "maximum": 10_000_000,
                                    "description": "seconds; at most 'end'",
                                },
                                "end": {
                                    "type": "number",
                                    "minimum": 0,
                                    "maximum": 10_000_000,
                                    "description": "seconds",
                                },
                                "text": {"type": "string"},
                            },
                        },
                    },
                },
            },
            "CompleteManyRequest": {
                "type": "object",
                "required": ["results"],
                "properties": {
                    "results": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_COMPLETIONS,
                        "description": (
                            "The job ids distinct; any entry that is not as "
                            "described (or a result the single completion "
                            "would refuse) is a 400 for the whole call, and "
                            "nothing is written."
                        ),
                        "items": {
                            "type": "object",
                            "required": ["job_id", "lease_token", "result"],
                            "additionalProperties": False,
                            "properties": {
                                "job_id": {"type": "integer"},
                                "lease_token": TOKEN,
                                "result": {"$ref": "#/components/schemas/Result"},
                            },
                        },
                    }
                },
            },
            "CompleteMany": {
                "type": "object",
                "required": ["results"],
                "additionalProperties": False,
                "properties": {
                    "results": {
                        "type": "array",
                        "items": {
                            "oneOf": [
                                {
                                    "type": "object",
                                    "description": (
                                        "Completed (now, or before with this "
                                        "token: a replay)."
                                    ),
                                    "required": ["job_id", "status"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "job_id": {"type": "integer"},
                                        "status": {
                                            "type": "string",
                                            "enum": [COMPLETED],
                                        },
                                    },
                                },
                                {
                                    "type": "object",
                                    "description": "Not completed, and why.",
                                    "required": ["job_id", "error"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "job_id": {"type": "integer"},
                                        "error": {
                                            "type": "string",
                                            "enum": [LEASE_LOST, NOT_FOUND],
                                        },
                                    },
                                },
                            ]
                        },
                    }
                },
            },
            "FailRequest": {
                "type": "object",
                "required": ["lease_token", "error"],
                "properties": {
                    "lease_token": TOKEN,
                    "error": {
                        "type": "string",
                        "description": "Kept, cut to 10,000 characters.",
                    },
                    "retryable": {"type": "boolean", "default": True},
                },
            },
            "Heartbeat": {
                "type": "object",
                "required": ["lease_expires_at"],
                "additionalProperties": False,
                "properties": {
                    "lease_expires_at": {"type": "string", "format": "date-time"}
                },
            },
            "HeartbeatManyRequest": {
                "type": "object",
                "required": ["leases"],
                "properties": {
                    "leases": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_HEARTBEAT_LEASES,
                        "description": "The job ids distinct (else 400).",
                        "items": {
                            "type": "object",
                            "required": ["job_id", "lease_token"],
                            "additionalProperties": False,
                            "properties": {
                                "job_id": {"type": "integer"},
                                "lease_token": TOKEN,
                            },
                        },
                    }
                },
            },
            "HeartbeatMany": {
                "type": "object",
                "required": ["leases"],
                "additionalProperties": False,
                "properties": {
                    "leases": {
                        "type": "array",
                        "items": {
                            "oneOf": [
                                {
                                    "type": "object",
                                    "description": "Renewed.",
                                    "required": ["job_id", "lease_expires_at"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "job_id": {"type": "integer"},
                                        "lease_expires_at": {
                                            "type": "string",
                                            "format": "date-time",
                                        },
                                    },
                                },
                                {
                                    "type": "object",
                                    "description": "Not renewed, and why.",
                                    "required": ["job_id", "error"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "job_id": {"type": "integer"},
                                        "error": {
                                            "type": "string",
                                            "enum": [LEASE_LOST, NOT_FOUND],
                                        },
                                    },
                                },
                            ]
                        },
                    }
                },
            },
            "Status": {
                "type": "object",
                "required": ["status"],
                "additionalProperties": False,
                "properties": {
                    "status": {
                        "type": "string",
                        "enum": ["completed", "queued", "failed"],
                    }
                },
            },
        },
    },
}
