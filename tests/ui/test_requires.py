"""What a batch requires of workers, on the operator pages (issue 26): set on
the new-batch form, changed on the batch page by those with the change
permission while the batch is open, shown with the wait it causes on the
batch page, the list and the overview; the workers page shows each worker's
labels."""

from __future__ import annotations

import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches.intake_records import Intake
from batches.models import Batch
from engine.background_intake import run_intake
from engine.manifests import create_batch
from jobs import transitions
from jobs.models import Event, Worker
from tests.support.clients import changer_client, page_messages
from tests.support.factories import make_batch

pytestmark = pytest.mark.django_db

WAITING = "Waiting for a worker with model=large-v3"


def _routed(requires: dict, name: str = "routed") -> Batch:
    lines = [f"file:///audio/{name}-{i}.wav\n" for i in range(3)]
    return create_batch(name, lambda: iter(lines), requires=requires)


def _online(name: str, labels: dict) -> Worker:
    worker, _ = transitions.create_worker(name)
    Worker.objects.filter(pk=worker.pk).update(labels=labels, last_seen=timezone.now())
    return worker


# --- Setting them ------------------------------------------------------------------


@pytest.mark.parametrize(
    "typed",
    [
        "gpu=a100, model=large-v3",
        "gpu=a100\nmodel=large-v3\n",
        " model = large-v3 ,\r\n gpu=a100 ",
    ],
)
def test_the_new_batch_form_takes_requirements(operator_client, typed):
    response = operator_client.post(
        "/batches/new/",
        {"name": "Routed", "priority": 0, "requires": typed, "sources": "/a\n/b"},
    )

    assert response.status_code == 302
    batch = Batch.objects.get(name="Routed")
    assert (batch.requires, batch.total) == ({"gpu": "a100", "model": "large-v3"}, 2)


def test_the_new_batch_form_without_requirements_requires_nothing(operator_client):
    operator_client.post(
        "/batches/new/", {"name": "Open", "priority": 0, "sources": "/a"}
    )
    assert Batch.objects.get(name="Open").requires == {}


@pytest.mark.parametrize(
    ("typed", "error"),
    [
        ("gpu", "requires: &#x27;gpu&#x27; is not KEY=VALUE"),
        ("gpu=a100, gpu=h100", "requires: &#x27;gpu&#x27; is given twice"),
        ("GPU=a100", "requires: key &#x27;GPU&#x27; must be 1 to 63 characters"),
        ("gpu=a 100", "requires: value of &#x27;gpu&#x27; must be 1 to 63"),
        ("gpu=", "requires: value of &#x27;gpu&#x27; must be 1 to 63"),
        (
            ",".join(f"k{i}=v" for i in range(17)),
            "requires: at most 16 labels, got 17",
        ),
        ("gpu=a100\x00", "Requires must not contain NUL characters."),
    ],
)
def test_bad_requirements_are_a_form_error(operator_client, typed, error):
    response = operator_client.post(
        "/batches/new/",
        {"name": "Bad", "priority": 0, "requires": typed, "sources": "/a"},
    )

    assert response.status_code == 400
    page = response.content.decode()
    assert error in page
    assert '<div class="field invalid">\n    <label for="id_requires">' in page
    assert not Batch.objects.exists()


def test_a_background_intake_keeps_the_requirements(operator_client, settings):
    settings.RECALL_BACKGROUND_INTAKE_BYTES = 10
    upload = SimpleUploadedFile("big.txt", b"/a\n/b\n/c\n/d\n", "text/plain")

    response = operator_client.post(
        "/batches/new/",
        {
            "name": "Big",
            "priority": 0,
            "requires": "model=large-v3",
            "manifest": upload,
        },
    )

    intake = Intake.objects.get()
    assert response.status_code == 302
    assert intake.requires == {"model": "large-v3"}
    run_intake(intake.pk)
    assert Batch.objects.get(name="Big").requires == {"model": "large-v3"}


# --- Changing them on the batch page -----------------------------------------------


def test_a_user_with_the_change_permission_edits_them(settings):
    client, user = changer_client()
    batch = make_batch(2)

    page = client.get(f"/batches/{batch.pk}/").content.decode()
    assert f'action="/batches/{batch.pk}/requires"' in page
    response = client.post(
        f"/batches/{batch.pk}/requires",
        {"requires": "model=large-v3\ngpu=a100", "return_query": "state=queued"},
        follow=True,
    )

    assert response.redirect_chain == [(f"/batches/{batch.pk}/?state=queued", 302)]
    assert page_messages(response) == [
        "Changed requires nothing -> gpu=a100, model=large-v3; the next claim "
        "follows it."
    ]
    batch.refresh_from_db()
    assert batch.requires == {"gpu": "a100", "model": "large-v3"}
    assert Event.objects.get(kind=Event.Kind.BATCH_CHANGED).actor == user
    page = response.content.decode()
    assert "requires <span data-requires>gpu=a100, model=large-v3</span>" in page
    # The form shows what it requires now, as pairs to edit.
    assert re.search(
        r'<textarea name="requires"[^>]*>\s*gpu=a100, model=large-v3<', page
    )

    response = client.post(
        f"/batches/{batch.pk}/requires", {"requires": ""}, follow=True
    )
    assert page_messages(response) == [
        "Changed requires gpu=a100, model=large-v3 -> nothing; the next claim "
        "follows it."
    ]
    response = client.post(
        f"/batches/{batch.pk}/requires", {"requires": ""}, follow=True
    )
    assert page_messages(response) == ["Nothing to change."]


def test_bad_requirements_change_nothing_and_say_why():
    client, _ = changer_client()
    batch = make_batch(1)

    response = client.post(
        f"/batches/{batch.pk}/requires", {"requires": "model"}, follow=True
    )

    assert page_messages(response) == [
        "Nothing was changed. requires: 'model' is not KEY=VALUE"
    ]
    assert Batch.objects.get(pk=batch.pk).requires == {}


def test_a_closed_batch_refuses_the_change(worker):
    client, _ = changer_client()
    batch = make_batch(1)
    transitions.cancel_batch(batch)

    page = client.get(f"/batches/{batch.pk}/").content.decode()
    assert "/requires" not in page  # no edit control once closed
    response = client.post(
        f"/batches/{batch.pk}/requires", {"requires": "gpu=a100"}, follow=True
    )

    assert page_messages(response) == [
        f"Nothing was changed. Batch {batch.pk} is cancelled: its requirements "
        f"can be changed only while it is open."
    ]
    assert Batch.objects.get(pk=batch.pk).requires == {}


def test_without_the_change_permission_there_is_no_control_and_a_403(
    operator_client, viewer_client
):
    batch = make_batch(1)

    for client in (operator_client, viewer_client):
        page = client.get(f"/batches/{batch.pk}/").content.decode()
        assert f"/batches/{batch.pk}/requires" not in page
        response = client.post(f"/batches/{batch.pk}/requires", {"requires": "a=b"})
        assert response.status_code == 403
    assert Batch.objects.get(pk=batch.pk).requires == {}
    assert not Event.objects.exists()


def test_the_change_is_post_only():
    client, _ = changer_client()
    batch = make_batch(1)
    assert client.get(f"/batches/{batch.pk}/requires").status_code == 405


# --- Showing them, and the wait -----------------------------------------------------


def test_the_batch_page_says_which_labels_nobody_offers(viewer_client):
    batch = _routed({"gpu": "a100", "model": "large-v3"})
    _online("a100-small", {"gpu": "a100", "model": "small"})

    page = viewer_client.get(f"/batches/{batch.pk}/").content.decode()

    assert f"<strong>{WAITING}.</strong>" in page
    assert '<dd data-eta>— <span class="muted small">(waiting for a worker)' in page
    assert "Unknown: waiting for a worker with model=large-v3." in page
    body = viewer_client.get(f"/batches/{batch.pk}/progress.json").json()
    assert (body["requires"], body["waiting_for_worker"], body["eta_seconds"]) == (
        {"gpu": "a100", "model": "large-v3"},
        True,
        None,
    )


def test_a_batch_a_worker_online_can_take_does_not_wait(viewer_client):
    batch = _routed({"gpu": "a100"})
    _online("a100", {"gpu": "a100", "model": "large-v3"})

    page = viewer_client.get(f"/batches/{batch.pk}/").content.decode()
    body = viewer_client.get(f"/batches/{batch.pk}/progress.json").json()

    assert "Waiting for a worker" not in page and "data-waiting" not in page
    assert (body["requires"], body["waiting_for_worker"]) == ({"gpu": "a100"}, False)


def test_the_list_and_the_overview_name_the_missing_labels(viewer_client):
    waiting = _routed({"model": "large-v3"}, name="needs-large")
    served = _routed({"gpu": "a100"}, name="a100-only")
    _online("a100", {"gpu": "a100"})

    for url in ("/", "/batches/live", "/overview/", "/overview/live"):
        page = viewer_client.get(url).content.decode()
        rows = dict(
            re.findall(r'<a href="/batches/(\d+)/">[^<]*</a>(.*?)</tr>', page, re.S)
        )
        assert (
            f'<div class="small waiting-worker" data-waiting>{WAITING}</div>'
            in (rows[str(waiting.pk)])
        ), url
        assert "requires model=large-v3" in rows[str(waiting.pk)]
        assert "Waiting" not in rows[str(served.pk)], url
        assert "requires gpu=a100" in rows[str(served.pk)]


def test_the_workers_page_shows_each_workers_labels(viewer_client):
    _online("a100", {"model": "large-v3", "gpu": "a100"})
    transitions.create_worker("plain")

    page = viewer_client.get("/workers/").content.decode()

    rows = dict(re.findall(r'<th scope="row">([\w-]+)(.*?)</tr>', page, re.S))
    assert (
        '<td class="labels" data-labels>gpu=a100, model=large-v3</td>' in rows["a100"]
    )
    assert (
        '<td class="labels" data-labels><span class="muted">none</span>'
        in (rows["plain"])
    )
