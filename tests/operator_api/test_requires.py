"""The Operator API and what a batch requires of workers (issue 26):
``POST /api/v1/batches`` takes ``requires``; the batch's answers show it and
whether the batch waits for a worker."""

from __future__ import annotations

import pytest
from django.utils import timezone

from batches.models import Batch
from jobs.models import Worker
from tests.support.factories import make_worker

pytestmark = pytest.mark.django_db

ITEMS = [{"source": "file:///calls/a.wav"}, {"source": "file:///calls/b.wav"}]


def test_a_submission_stores_the_requirements_and_answers_with_them(operator_api):
    response = operator_api.post(
        "/api/v1/batches",
        {"name": "routed", "requires": {"model": "large-v3"}, "items": ITEMS},
    )

    assert response.status_code == 201, response.content
    batch = Batch.objects.get()
    assert batch.requires == {"model": "large-v3"}
    body = response.json()["batch"]
    assert (body["requires"], body["waiting_for_worker"], body["eta_seconds"]) == (
        {"model": "large-v3"},
        True,
        None,
    )


def test_the_batch_says_whether_it_waits_for_a_worker(operator_api):
    created = operator_api.post(
        "/api/v1/batches",
        {"name": "routed", "requires": {"gpu": "a100"}, "items": ITEMS},
    ).json()["batch"]
    plain = operator_api.post(
        "/api/v1/batches", {"name": "plain", "items": ITEMS}
    ).json()["batch"]

    def shown(batch_id: int) -> tuple:
        body = operator_api.get(f"/api/v1/batches/{batch_id}").json()
        return body["requires"], body["waiting_for_worker"]

    assert shown(created["id"]) == ({"gpu": "a100"}, True)
    assert shown(plain["id"]) == ({}, True)  # nobody online at all
    worker = make_worker("t4")
    Worker.objects.filter(pk=worker.pk).update(
        labels={"gpu": "t4"}, last_seen=timezone.now()
    )
    assert shown(created["id"]) == ({"gpu": "a100"}, True)
    assert shown(plain["id"]) == ({}, False)
    Worker.objects.filter(pk=worker.pk).update(labels={"gpu": "a100"})
    assert shown(created["id"]) == ({"gpu": "a100"}, False)
    listed = operator_api.get("/api/v1/batches").json()["batches"]
    assert [(b["requires"], b["waiting_for_worker"]) for b in listed] == [
        ({}, False),
        ({"gpu": "a100"}, False),
    ]


def test_null_requires_nothing(operator_api):
    response = operator_api.post(
        "/api/v1/batches", {"name": "x", "requires": None, "items": ITEMS}
    )
    assert response.status_code == 201
    assert Batch.objects.get().requires == {}


@pytest.mark.parametrize(
    ("requires", "detail"),
    [
        ("gpu=a100", "Field 'requires' must be an object of KEY: VALUE strings."),
        (["gpu"], "Field 'requires' must be an object of KEY: VALUE strings."),
        (
            {"GPU": "a100"},
            "Field 'requires': key 'GPU' must be 1 to 63 characters of a-z, 0-9, "
            "'_', '.' and '-', starting with a letter or digit.",
        ),
        (
            {"gpu": 100},
            "Field 'requires': value of 'gpu' must be 1 to 63 characters of A-Z, "
            "a-z, 0-9 and '_.:/-'.",
        ),
        (
            {"gpu": ""},
            "Field 'requires': value of 'gpu' must be 1 to 63 characters of A-Z, "
            "a-z, 0-9 and '_.:/-'.",
        ),
        (
            {f"k{i}": "v" for i in range(17)},
            "Field 'requires': at most 16 labels, got 17.",
        ),
    ],
)
def test_bad_requirements_are_400_and_nothing_is_created(
    operator_api, requires, detail
):
    response = operator_api.post(
        "/api/v1/batches", {"name": "x", "requires": requires, "items": ITEMS}
    )

    assert response.status_code == 400
    assert response.json() == {"error": "bad_request", "detail": detail}
    assert not Batch.objects.exists()
