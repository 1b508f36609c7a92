"""``POST /api/v1/batches/<id>/rerun`` (issue 29): the pinned shapes, who may,
and every refusal, each writing nothing."""

from __future__ import annotations

import pytest

from batches.models import Batch
from jobs import transitions
from jobs.models import Event, Job, JobRun
from tests.support.clients import ApiClient, token_for
from tests.support.factories import (
    finished_batch,
    item_ids,
    jobs_of,
    make_batch,
    make_changer,
    make_worker,
    snapshot,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def changer(db):
    """An operator who may also change batches (``batches.change_batch``)."""
    return make_changer()


@pytest.fixture
def changer_api(changer) -> ApiClient:
    return ApiClient(token_for(changer))


def rerun(api: ApiClient, batch_id: int, body, **kwargs):
    return api.post(f"/api/v1/batches/{batch_id}/rerun", body, **kwargs)


def test_rerun_chosen_items_answers_how_many(changer_api, changer):
    batch = finished_batch(3)
    first, second, _ = item_ids(batch)

    response = rerun(
        changer_api,
        batch.pk,
        {"items": [first, second, first], "requires": {"model": "large-v3"}},
    )

    assert response.status_code == 200, response.content
    assert response.json() == {"rerun": 2}
    assert sorted(
        Job.objects.filter(status="queued").values_list("item_id", flat=True)
    ) == [first, second]
    assert all(
        job.requires == {"model": "large-v3"}
        for job in Job.objects.filter(status="queued")
    )
    event = Event.objects.get(kind=Event.Kind.RERUN)
    assert event.actor == changer and event.batch_id == batch.pk
    detail = changer_api.get(f"/api/v1/batches/{batch.pk}").json()
    assert detail["state"] == "running"
    assert detail["counts"]["queued"] == 2 and detail["counts"]["done"] == 1


def test_rerun_by_flag(changer_api):
    batch = finished_batch(durations=[60.0, 60.0, 5.0])  # two short, one too brief

    response = rerun(changer_api, batch.pk, {"flag": "short"})

    assert response.status_code == 200, response.content
    assert response.json() == {"rerun": 2}
    detail = changer_api.get(f"/api/v1/batches/{batch.pk}").json()
    assert detail["flags"] == {"empty": 0, "short": 0, "language_mismatch": 0}
    assert rerun(changer_api, batch.pk, {"flag": "empty"}).json() == {"rerun": 0}


def test_who_may_rerun(changer_api, operator_api, viewer_api, stranger_api):
    batch = finished_batch(1)
    body = {"items": item_ids(batch)}
    for api in (operator_api, viewer_api, stranger_api):
        response = rerun(api, batch.pk, body)
        assert response.status_code == 403
        assert response.json()["error"] == "forbidden"
        assert "batches.change_batch" in response.json()["detail"]
    assert rerun(ApiClient(None), batch.pk, body).status_code == 401
    assert not JobRun.objects.exists()
    assert changer_api.get(f"/api/v1/batches/{batch.pk}/rerun").status_code == 405
    assert rerun(changer_api, batch.pk, body).status_code == 200


@pytest.mark.parametrize(
    "body, detail",
    [
        ({}, "Send either 'items'"),
        ({"items": [1], "flag": "short"}, "not both"),
        ({"flag": "short", "why": "x"}, "Unknown field(s) 'why'"),
        ({"items": []}, "non-empty list"),
        ({"items": "1,2"}, "non-empty list"),
        ({"items": [True]}, "item ids (whole numbers)"),
        ({"items": ["1"]}, "item ids (whole numbers)"),
        ({"items": [0]}, "0 is not an item id"),
        ({"items": [2**63]}, "is not an item id"),
        ({"items": list(range(1, 10_002))}, "at most 10000 items"),
        ({"flag": "loud"}, "Field 'flag' must be one of empty, short"),
        ({"flag": 1}, "Field 'flag' must be one of"),
        ({"flag": "short", "requires": {"GPU": "x"}}, "Field 'requires': key"),
        ({"flag": "short", "requires": "gpu=a100"}, "must be an object"),
        ([], "object"),
    ],
)
def test_bad_requests_are_400_and_write_nothing(changer_api, body, detail):
    batch = finished_batch(2)
    everything = snapshot(*jobs_of(batch))

    response = rerun(changer_api, batch.pk, body)

    assert response.status_code == 400, response.content
    assert response.json()["error"] == "bad_request"
    assert detail in response.json()["detail"]
    assert snapshot(*jobs_of(batch)) == everything


def test_a_requirement_that_clashes_with_the_batch_is_400(changer_api):
    batch = finished_batch(1)
    Batch.objects.filter(pk=batch.pk).update(requires={"model": "small"})

    response = rerun(
        changer_api, batch.pk, {"items": item_ids(batch), "requires": {"model": "big"}}
    )

    assert response.status_code == 400
    assert "the batch requires model=small" in response.json()["detail"]
    assert not JobRun.objects.exists()


def test_unknown_batch_and_foreign_items_are_404(changer_api):
    batch, other = finished_batch(1), make_batch(1, name="other")
    assert rerun(changer_api, 10**9, {"flag": "short"}).status_code == 404
    foreign = item_ids(other)[0]

    response = rerun(changer_api, batch.pk, {"items": [*item_ids(batch), foreign]})

    assert response.status_code == 404
    body = response.json()
    assert (body["error"], body["missing"], body["not_rerunnable"]) == (
        "not_found",
        [foreign],
        [],
    )
    assert not JobRun.objects.exists()


def test_items_still_queued_or_in_flight_are_409_and_nothing_reruns(changer_api):
    batch = make_batch(3)
    worker = make_worker()
    done = transitions.claim_next(worker)
    transitions.complete(done, done.lease_token, worker=worker, result={"text": "a"})
    leased = transitions.claim_next(worker)
    everything = snapshot(*jobs_of(batch))
    first, second, third = item_ids(batch)

    response = rerun(changer_api, batch.pk, {"items": [first, second, third]})

    assert response.status_code == 409
    body = response.json()
    assert body["error"] == "not_rerunnable"
    assert body["not_rerunnable"] == [
        {"id": leased.item_id, "state": "transcribing"},
        {"id": third, "state": "queued"},
    ]
    assert snapshot(*jobs_of(batch)) == everything


def test_a_cancelled_batch_is_409(changer_api):
    batch = finished_batch(1)
    transitions.cancel_batch(batch)

    response = rerun(changer_api, batch.pk, {"items": item_ids(batch)})

    assert response.status_code == 409
    assert response.json()["error"] == "invalid_transition"
