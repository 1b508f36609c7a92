"""Re-run on the operator pages and in the admin (issue 29): ticked items or a
flag from the batch page, with an optional requirement, for those with the
batch's change permission (no control otherwise, and 403 on POST); the item
page shows the earlier runs beside the new one."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission

from jobs import transitions
from jobs.models import Event, Job, JobRun
from tests.support.clients import changer_client, client_for, page_messages
from tests.support.factories import (
    finished_batch,
    item_ids,
    make_batch,
    make_user,
    make_worker,
)

pytestmark = pytest.mark.django_db


FIRST = "first words"  # each item's transcript before the re-run


def test_the_batch_page_offers_a_rerun_only_with_the_change_permission(
    operator_client,
):
    batch = finished_batch(durations=[60.0, 60.0, 60.0], text=FIRST)
    page = operator_client.get(f"/batches/{batch.pk}/").content.decode()
    assert 'id="rerun-form"' not in page and 'name="item"' not in page
    response = operator_client.post(f"/batches/{batch.pk}/rerun", {"flag": "short"})
    assert response.status_code == 403
    assert not JobRun.objects.exists()

    client, _ = changer_client()
    page = client.get(f"/batches/{batch.pk}/").content.decode()
    assert 'id="rerun-form"' in page and "csrfmiddlewaretoken" in page
    assert page.count('form="rerun-form"') == 3  # a box per done item


def test_ticked_items_rerun_with_a_requirement(settings):
    client, user = changer_client()
    batch = finished_batch(durations=[60.0, 60.0, 60.0], text=FIRST)
    first, second, _ = item_ids(batch)

    response = client.post(
        f"/batches/{batch.pk}/rerun",
        {"item": [first, second], "flag": "", "requires": "model=large-v3"},
        follow=True,
    )

    assert response.status_code == 200
    assert page_messages(response) == [
        "Re-running 2 items on workers offering model=large-v3: queued as a new "
        "run; the earlier results stay in each item's history."
    ]
    assert sorted(
        Job.objects.filter(status="queued").values_list("item_id", flat=True)
    ) == [first, second]
    assert Job.objects.get(item_id=first).requires == {"model": "large-v3"}
    assert Event.objects.get(kind=Event.Kind.RERUN).actor == user

    # The item page: the new run and the earlier one beside it.
    worker = make_worker("big")
    job = transitions.claim_next(worker, labels={"model": "large-v3"})
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "the second words"}
    )
    page = client.get(f"/items/{job.item_id}/").content.decode()
    assert "Earlier runs" in page and 'data-run="1"' in page
    assert "first words" in page and "the second words" in page
    assert "run 2" in page and "model=large-v3" in page


def test_a_flag_reruns_every_item_with_it():
    client, _ = changer_client()
    batch = finished_batch(durations=[60.0, 5.0], text=FIRST)

    response = client.post(
        f"/batches/{batch.pk}/rerun", {"flag": "short", "requires": ""}, follow=True
    )

    assert page_messages(response)[0].startswith("Re-running 1 item flagged short:")
    assert Job.objects.filter(status="queued").count() == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"flag": ""}, "tick the items to re-run, or choose a flag"),
        ({"flag": "loud"}, "Nothing was re-run. Select a valid choice."),
        ({"flag": "short", "requires": "GPU=x"}, "Nothing was re-run. requires: key"),
        ({"item": ["abc"]}, "the items ticked are not valid"),
    ],
)
def test_bad_reruns_are_a_message_and_change_nothing(data, message):
    client, _ = changer_client()
    batch = finished_batch(durations=[60.0, 60.0, 60.0], text=FIRST)

    response = client.post(f"/batches/{batch.pk}/rerun", data, follow=True)

    assert response.status_code == 200
    assert message in " ".join(page_messages(response))
    assert not JobRun.objects.exists()


def test_items_not_done_are_refused_with_a_message():
    client, _ = changer_client()
    batch = make_batch(2)

    response = client.post(
        f"/batches/{batch.pk}/rerun", {"item": item_ids(batch)}, follow=True
    )

    assert "only done or failed items can be re-run" in " ".join(
        page_messages(response)
    )
    assert not JobRun.objects.exists()


def test_the_admin_reruns_the_selected_items_with_the_change_permission(
    admin_client,
):
    batch = finished_batch(durations=[60.0, 60.0], text=FIRST)
    queued = make_batch(1, name="queued")
    chosen = [*item_ids(batch), *item_ids(queued)]

    response = admin_client.post(
        "/admin/batches/batchitem/",
        {"action": "rerun_items", "_selected_action": chosen},
        follow=True,
    )

    assert response.status_code == 200
    assert (
        "Re-running 2 items as a new run; 1 skipped (not done or failed)."
        in " ".join(page_messages(response))
    )
    assert JobRun.objects.count() == 2


def test_the_admin_offers_no_rerun_without_the_change_permission(db):
    user = make_user("staff", "Operators", is_staff=True)
    user.user_permissions.add(
        Permission.objects.get(
            content_type__app_label="batches", codename="view_batchitem"
        )
    )
    client = client_for(user)
    batch = finished_batch(durations=[60.0], text=FIRST)

    page = client.get("/admin/batches/batchitem/").content.decode()
    assert "rerun_items" not in page
    client.post(
        "/admin/batches/batchitem/",
        {"action": "rerun_items", "_selected_action": item_ids(batch)},
    )
    assert not JobRun.objects.exists()


def test_the_batch_page_with_both_forms_has_no_id_twice():
    # The requirements' form, the filters and the re-run form have fields of
    # the same names: each must keep its own ids, or a label (and a browser
    # test's locator) finds the wrong field.
    batch = make_batch(durations=[60.0, 60.0])  # open: its requirements editable
    worker = make_worker("w-ids")
    job = transitions.claim_next(worker)
    transitions.complete(job, job.lease_token, worker=worker, result={"text": "a"})
    client, _ = changer_client()
    page = client.get(f"/batches/{batch.pk}/").content.decode()
    assert 'id="rerun-form"' in page and "requires-form" in page
    ids = re.findall(r'\sid="([^"]+)"', page)
    assert sorted({i for i in ids if ids.count(i) > 1}) == []
