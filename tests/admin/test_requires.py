"""The admin and worker labels (issue 26): a batch's requirements are edited
on its change page through ``set_requires`` while it is open, and each
worker's labels are shown."""

from __future__ import annotations

import pytest
from django.utils import timezone

from batches.models import Batch
from jobs import transitions
from jobs.models import Event, Worker
from tests.support.factories import make_batch, make_worker

pytestmark = pytest.mark.django_db

LIST = "/admin/batches/batch/"


def _form(batch: Batch, requires: str) -> dict:
    return {
        "name": batch.name,
        "priority": batch.priority,
        "weight": batch.weight,
        "max_in_flight": "",
        "requires": requires,
    }


def test_the_change_page_edits_the_requirements(superuser_client):
    batch = make_batch(2)

    response = superuser_client.post(
        f"{LIST}{batch.pk}/change/", _form(batch, "model=large-v3, gpu=a100")
    )

    assert response.status_code == 302
    batch.refresh_from_db()
    assert batch.requires == {"gpu": "a100", "model": "large-v3"}
    event = Event.objects.get(kind=Event.Kind.BATCH_CHANGED)
    assert event.message == "Changed requires nothing -> gpu=a100, model=large-v3."
    assert event.actor.username == "root-admin"
    page = superuser_client.get(f"{LIST}{batch.pk}/change/").content.decode()
    assert "\ngpu=a100, model=large-v3</textarea>" in page


def test_a_bad_requirement_is_a_form_error(superuser_client):
    batch = make_batch(1)

    response = superuser_client.post(f"{LIST}{batch.pk}/change/", _form(batch, "gpu"))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "requires": ["requires: 'gpu' is not KEY=VALUE"]
    }
    assert Batch.objects.get(pk=batch.pk).requires == {}


def test_saving_other_fields_leaves_the_requirements_alone(superuser_client):
    batch = make_batch(1)
    transitions.set_requires(batch, {"gpu": "a100"})

    superuser_client.post(
        f"{LIST}{batch.pk}/change/", {**_form(batch, "gpu=a100"), "weight": 3}
    )

    batch.refresh_from_db()
    assert (batch.requires, batch.weight) == ({"gpu": "a100"}, 3)
    assert Event.objects.filter(kind=Event.Kind.BATCH_CHANGED).count() == 2


def test_a_closed_batchs_requirements_are_read_only(superuser_client):
    batch = make_batch(1)
    transitions.set_requires(batch, {"gpu": "a100"})
    transitions.cancel_batch(batch)

    page = superuser_client.get(f"{LIST}{batch.pk}/change/")
    assert "requires" not in page.context["adminform"].form.fields
    superuser_client.post(f"{LIST}{batch.pk}/change/", _form(batch, "gpu=h100"))

    assert Batch.objects.get(pk=batch.pk).requires == {"gpu": "a100"}


def test_the_worker_admin_shows_the_labels(superuser_client):
    worker = make_worker("a100")
    Worker.objects.filter(pk=worker.pk).update(
        labels={"model": "large-v3", "gpu": "a100"}, last_seen=timezone.now()
    )
    make_worker("plain")

    listing = superuser_client.get("/admin/jobs/worker/").content.decode()
    page = superuser_client.get(f"/admin/jobs/worker/{worker.pk}/change/")

    assert '<td class="field-labels_column">gpu=a100, model=large-v3</td>' in listing
    assert '<td class="field-labels_column">-</td>' in listing
    assert "gpu=a100, model=large-v3" in page.content.decode()
