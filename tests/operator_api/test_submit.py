"""POST /api/v1/batches: the shape of a submission's answer, the manifest's
validation (every bad item listed, nothing created), and Idempotency-Key."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from django.db import connection

from batches.models import Batch, BatchItem
from jobs import transitions
from jobs.models import Job
from operator_api.idempotency import body_hash, forget_expired
from operator_api.models import IdempotencyKey
from tests.support.clients import ApiClient, token_for
from tests.support.factories import is_postgres, make_user

pytestmark = pytest.mark.django_db

ITEMS = [
    {"source": "file:///calls/a.wav", "duration_seconds": 30},
    {"source": "s3://calls/b.wav", "params": {"language": "de", "beam": 5}},
    {"source": "  /calls/c.wav  ", "duration_seconds": 1.5, "params": {}},
]


def test_a_submission_creates_the_batch_and_answers_its_progress(
    operator_api, operator
):
    response = operator_api.post(
        "/api/v1/batches",
        {
            "name": "nightly",
            "priority": 3,
            "weight": 2,
            "max_in_flight": 4,
            "items": ITEMS,
        },
    )

    assert response.status_code == 201, response.content
    batch = Batch.objects.get()
    assert response["Location"] == f"/api/v1/batches/{batch.pk}"
    body = response.json()
    assert list(body) == ["batch"]
    assert body["batch"] == {
        "id": batch.pk,
        "name": "nightly",
        "created_at": batch.created_at.isoformat(),
        "priority": 3,
        "batch": batch.pk,
        "state": "running",
        "total": 3,
        "counts": {
            "queued": 3,
            "transcribing": 0,
            "done": 0,
            "failed": 0,
            "cancelled": 0,
        },
        "percent_done": 0.0,
        "throughput_per_minute": 0.0,
        "eta_seconds": None,
        "weight": 2,
        "max_in_flight": 4,
        "in_flight": 0,
        # Added by silent leases and retry waits (issue 27).
        "silent": 0,
        "retry": None,
        # Added by routing (issue 26): no worker is online, so even a batch that
        # requires nothing waits for one.
        "requires": {},
        "waiting_for_worker": True,
    }
    assert (batch.priority, batch.weight, batch.max_in_flight) == (3, 2, 4)
    assert batch.created_by == operator
    items = list(BatchItem.objects.filter(batch=batch).order_by("pk"))
    assert [(i.source, i.params, i.duration_ms) for i in items] == [
        ("file:///calls/a.wav", {}, 30_000),
        ("s3://calls/b.wav", {"language": "de", "beam": 5}, None),
        ("/calls/c.wav", {}, 1_500),
    ]
    assert Job.objects.filter(batch=batch).count() == 3


def test_the_answer_matches_progress_json(operator_api, operator_client):
    batch_id = operator_api.post(
        "/api/v1/batches", {"name": "x", "items": ITEMS}
    ).json()["batch"]["id"]

    api = operator_api.get(f"/api/v1/batches/{batch_id}").json()
    ui = operator_client.get(f"/batches/{batch_id}/progress.json").json()

    assert {
        k: v
        for k, v in api.items()
        if k not in ("id", "name", "created_at", "priority")
    } == ui
    assert api["id"] == batch_id


@pytest.fixture
def operator_client(operator):
    from django.test import Client

    client = Client()
    client.force_login(operator)
    return client


def _bad(response) -> dict:
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["error"] == "bad_request"
    return body


def test_every_bad_item_is_listed_by_index_and_nothing_is_created(operator_api):
    items = [
        {"source": "file:///ok.wav"},
        {"source": ""},
        "just-a-string",
        {"source": "-rf"},
        {"source": "file:///ok2.wav", "duration_seconds": -1},
        {"source": "ftp://x/y.wav"},
        {"source": "file:///ok3.wav", "params": {"a": {"nested": 1}}},
        {"source": "file:///ok4.wav", "colour": "red"},
        {"source": "a\u202eb.wav"},
        {"source": 5},
        {"source": "file:///ok5.wav", "duration_seconds": "30"},
    ]

    body = _bad(operator_api.post("/api/v1/batches", {"name": "bad", "items": items}))

    assert [e["index"] for e in body["errors"]] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert body["total_errors"] == 10
    assert body["errors"][0] == {"index": 1, "message": "the source is empty"}
    assert body["errors"][1] == {
        "index": 2,
        "message": "an item must be an object with a 'source'",
    }
    assert body["errors"][6] == {
        "index": 7,
        "message": "unknown field(s) 'colour'; an item has 'source', "
        "'duration_seconds' and 'params'",
    }
    assert body["errors"][9] == {
        "index": 10,
        "message": "'duration_seconds' must be a number or null",
    }
    assert body["detail"].startswith(
        "10 problem(s) with the items; nothing was created. items[1]: the source "
        "is empty; items[2]: an item must be an object"
    )
    assert body["detail"].endswith("; and 5 more (see 'errors').")
    assert Batch.objects.count() == 0 and BatchItem.objects.count() == 0


def test_the_manifest_limit_on_items_applies(operator_api, settings):
    settings.RECALL_MAX_MANIFEST_ITEMS = 2
    body = _bad(operator_api.post("/api/v1/batches", {"name": "big", "items": ITEMS}))
    assert body["errors"] == [
        {"index": None, "message": "there are 3 items; the limit is 2"}
    ]
    assert Batch.objects.count() == 0


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"items": ITEMS}, "Missing field 'name'."),
        ({"name": "x"}, "Missing field 'items'."),
        ({"name": 5, "items": ITEMS}, "Field 'name' must be a string, not a number."),
        ({"name": "x", "items": {}}, "Field 'items' must be an array, not an object."),
        (
            {"name": "  ", "items": ITEMS},
            "Nothing was created: the batch needs a name.",
        ),
        (
            {"name": "x" * 201, "items": ITEMS},
            "Nothing was created: the name must be at most 200 printable characters.",
        ),
        (  # the schema's limit is on the value sent, spaces included
            {"name": " " + "x" * 200, "items": ITEMS},
            "Nothing was created: the name must be at most 200 printable characters.",
        ),
        (
            {"name": "x", "items": []},
            "1 problem(s) with the items; nothing was created. the batch has no items.",
        ),
        (
            {"name": "x", "items": ITEMS, "priority": 40000},
            "Field 'priority' must be from -32768 to 32767.",
        ),
        (
            {"name": "x", "items": ITEMS, "weight": 0},
            "Field 'weight' must be from 1 to 1000.",
        ),
        (
            {"name": "x", "items": ITEMS, "weight": 1.5},
            "Field 'weight' must be a whole number.",
        ),
        (
            {"name": "x", "items": ITEMS, "max_in_flight": True},
            "Field 'max_in_flight' must be a whole number.",
        ),
        (
            {"name": "x", "items": ITEMS, "owner": "me"},
            "Unknown field(s) 'owner'; a batch has 'items', 'max_in_flight', 'name', 'priority', 'requires', 'weight'.",
        ),
    ],
)
def test_bad_fields_are_400_and_nothing_is_created(operator_api, body, detail):
    assert _bad(operator_api.post("/api/v1/batches", body))["detail"] == detail
    assert Batch.objects.count() == 0


def test_a_source_is_as_long_as_it_was_sent(operator_api):
    # The schema's maxLength counts the spaces the intake strips.
    longest = "/calls/" + "a" * 4089  # 4,096 characters
    over = {"name": "x", "items": [{"source": f" {longest}"}]}
    body = _bad(operator_api.post("/api/v1/batches", over))

    assert body["errors"] == [
        {"index": 0, "message": "the source is longer than 4096 characters"}
    ]
    assert Batch.objects.count() == 0
    created = operator_api.post(
        "/api/v1/batches", {"name": "x", "items": [{"source": longest}]}
    )
    assert created.status_code == 201
    assert BatchItem.objects.get().source == longest


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (b"[]", "The body must be a JSON object, not an array."),
        (b"{", None),
        (
            b'{"name": "x\\u0000", "items": []}',
            "Strings must not contain NUL (\\u0000) characters.",
        ),
    ],
)
def test_malformed_bodies_are_400(operator_api, raw, detail):
    body = _bad(operator_api.post("/api/v1/batches", raw=raw))
    if detail:
        assert body["detail"] == detail
    assert Batch.objects.count() == 0


def test_a_body_over_the_limit_is_413(operator_api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    items = [{"source": f"file:///{i}.wav"} for i in range(100)]
    response = operator_api.post("/api/v1/batches", {"name": "x", "items": items})
    assert response.status_code == 413
    assert response.json()["error"] == "payload_too_large"
    assert Batch.objects.count() == 0


# --- Idempotency-Key -------------------------------------------------------------------


def _submit(api: ApiClient, key: str, body: dict | None = None):
    return api.post(
        "/api/v1/batches",
        body or {"name": "nightly", "items": ITEMS},
        headers={"Idempotency-Key": key},
    )


def test_the_same_key_twice_returns_the_first_batch(operator_api):
    first = _submit(operator_api, "2026-01-01-calls")
    again = _submit(operator_api, "2026-01-01-calls")

    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["batch"]["id"] == first.json()["batch"]["id"]
    assert again["Location"] == first["Location"]
    assert Batch.objects.count() == 1
    # The same body in another key order and spacing is the same submission.
    reordered = operator_api.post(
        "/api/v1/batches",
        raw=b'{"items": ' + json.dumps(ITEMS).encode() + b', "name": "nightly"}',
        headers={"Idempotency-Key": "2026-01-01-calls"},
    )
    assert reordered.status_code == 200
    assert Batch.objects.count() == 1


def test_the_same_key_with_another_body_is_a_409(operator_api):
    first = _submit(operator_api, "k1")
    response = _submit(operator_api, "k1", {"name": "other", "items": ITEMS})

    assert response.status_code == 409
    assert response.json() == {
        "error": "idempotency_conflict",
        "detail": f"The Idempotency-Key 'k1' was used within the last 24 hours for "
        f"another submission (batch {first.json()['batch']['id']}); use a new key "
        f"for a new batch.",
    }
    assert Batch.objects.count() == 1


def test_keys_are_per_user(operator_api, db):
    other = ApiClient(token_for(make_user("other-operator", "Operators")))
    a = _submit(operator_api, "shared-name").json()["batch"]["id"]
    b = _submit(other, "shared-name").json()["batch"]["id"]
    assert a != b and Batch.objects.count() == 2


def test_a_key_older_than_24_hours_makes_a_new_batch(operator_api):
    first = _submit(operator_api, "daily").json()["batch"]["id"]
    IdempotencyKey.objects.update(
        created_at=transitions.now() - timedelta(hours=24, seconds=1)
    )

    response = _submit(operator_api, "daily", {"name": "changed", "items": ITEMS})

    assert response.status_code == 201
    assert response.json()["batch"]["id"] != first
    # The expired row was replaced, not kept beside the new one.
    assert IdempotencyKey.objects.count() == 1
    assert IdempotencyKey.objects.get().batch_id == response.json()["batch"]["id"]


def test_expired_keys_are_forgotten_for_users_who_never_come_back(operator_api):
    other = ApiClient(token_for(make_user("other-operator", "Operators")))
    for key in ("a", "b", "c"):
        _submit(operator_api, key)
    _submit(other, "d")
    now = transitions.now()
    # "a" and "d" are past the TTL, "b" at it to the microsecond, "c" within it.
    ages = {"a": 30, "b": 24, "c": 23, "d": 25}
    for key, hours in ages.items():
        IdempotencyKey.objects.filter(key=key).update(
            created_at=now - timedelta(hours=hours)
        )

    forgotten = forget_expired(now=now, chunk=2)

    assert forgotten == 3
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["c"]
    # Their batches stay; only the keys are gone.
    assert Batch.objects.count() == 4
    assert forget_expired(now=now) == 0


def test_an_invalid_submission_keeps_no_key(operator_api):
    bad = _submit(operator_api, "k", {"name": "x", "items": [{"source": ""}]})
    assert bad.status_code == 400
    assert IdempotencyKey.objects.count() == 0
    # The client fixes its items and retries with the same key.
    assert _submit(operator_api, "k").status_code == 201


@pytest.mark.parametrize("key", ["", "x" * 256, "caf\u00e9"])
def test_a_malformed_key_is_400(operator_api, key):
    body = _bad(_submit(operator_api, key))
    assert body["detail"].startswith("The Idempotency-Key header must be 1 to 255")
    assert Batch.objects.count() == 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_racing_twins_with_one_key_create_one_batch():
    """Eight threads submit the same body with the same key at once: the unique
    constraint decides; everyone gets the winner's batch."""
    assert is_postgres()
    operator = make_user("racer", "Operators")
    token = token_for(operator)
    body = {
        "name": "race",
        "items": [{"source": f"file:///{i}.wav"} for i in range(200)],
    }
    barrier = threading.Barrier(8)
    answers: list[tuple[int, int]] = []
    lock = threading.Lock()

    def submit() -> None:
        try:
            api = ApiClient(token)
            barrier.wait()
            response = _submit(api, "race-key", body)
            with lock:
                answers.append((response.status_code, response.json()["batch"]["id"]))
        finally:
            connection.close()

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    batch = Batch.objects.get()
    assert sorted(status for status, _ in answers) == [200] * 7 + [201]
    assert {batch_id for _, batch_id in answers} == {batch.pk}
    assert batch.total == 200 and BatchItem.objects.count() == 200
    key = IdempotencyKey.objects.get()
    assert (key.batch_id, key.body_hash) == (batch.pk, body_hash(body))
