"""Every page needs a login; every page and action checks its permission."""

import pytest
from django.test import Client

from jobs import transitions
from jobs.models import Job
from tests.support.clients import client_for
from tests.support.factories import claim, make_batch

pytestmark = pytest.mark.django_db

PAGES = [
    "/",
    "/batches/live",
    "/batches/{b}/",
    "/batches/{b}/live",
    "/batches/{b}/items/live",
    "/batches/{b}/progress.json",
    "/items/{i}/",
    "/workers/",
    "/overview/",
    "/overview/live",
]
OPERATOR_PAGES = [
    "/batches/new/",
    "/batches/{b}/export.csv",
    "/batches/{b}/export.jsonl",
    "/batches/{b}/export.zip",
]
ACTIONS = ["pause", "resume", "cancel", "retry"]


def _urls(urls, batch):
    return [u.format(b=batch.pk, i=batch.items.first().pk) for u in urls]


@pytest.fixture
def batch(db):
    return make_batch(3)


def test_anonymous_users_are_sent_to_the_login_page(batch):
    client = Client()
    for url in _urls(PAGES + OPERATOR_PAGES, batch):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/accounts/login/?next="), url
    for action in ACTIONS:
        response = client.post(f"/batches/{batch.pk}/{action}")
        assert response.status_code == 302
        assert response["Location"].startswith("/accounts/login/")


def test_a_user_without_permissions_gets_403(stranger, batch):
    client = client_for(stranger)
    for url in _urls(PAGES + OPERATOR_PAGES, batch):
        assert client.get(url).status_code == 403, url


def test_viewers_see_pages_but_cannot_act_create_or_export(viewer_client, batch):
    for url in _urls(PAGES, batch):
        assert viewer_client.get(url).status_code == 200, url
    for url in _urls(OPERATOR_PAGES, batch):
        assert viewer_client.get(url).status_code == 403, url
    for action in ACTIONS:
        assert viewer_client.post(f"/batches/{batch.pk}/{action}").status_code == 403
    page = viewer_client.get(f"/batches/{batch.pk}/").content.decode()
    assert "Pause</button>" not in page
    assert "Cancel batch" not in page
    assert "export.csv" not in page
    assert "/batches/new/" not in viewer_client.get("/").content.decode()
    batch.refresh_from_db()
    assert (batch.paused_at, batch.cancelled_at) == (None, None)


def test_operators_get_the_buttons(operator_client, batch):
    page = operator_client.get(f"/batches/{batch.pk}/").content.decode()

    assert f'action="/batches/{batch.pk}/pause"' in page
    assert f'action="/batches/{batch.pk}/cancel"' in page
    assert f"/batches/{batch.pk}/export.csv" in page


def test_actions_are_post_only(operator_client, batch):
    for action in ACTIONS:
        assert operator_client.get(f"/batches/{batch.pk}/{action}").status_code == 405


def test_actions_need_a_csrf_token(operator, batch):
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)

    assert client.post(f"/batches/{batch.pk}/pause").status_code == 403
    batch.refresh_from_db()
    assert batch.paused_at is None


def test_unknown_batch_and_item_are_404(viewer_client, db):
    assert viewer_client.get("/batches/999/").status_code == 404
    assert viewer_client.get("/items/999/").status_code == 404
    assert viewer_client.get("/batches/999/progress.json").status_code == 404


def test_unknown_export_format_is_404(operator_client, batch):
    assert operator_client.get(f"/batches/{batch.pk}/export.xml").status_code == 404


def test_text_from_workers_is_escaped(viewer_client, worker, batch):
    evil = "<script>alert('x')</script>"
    job = claim(worker)
    transitions.fail(job, job.lease_token, worker=worker, error=evil, retryable=False)
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": evil, "language": evil}
    )
    pages = [
        viewer_client.get(f"/items/{j.item_id}/").content.decode()
        for j in Job.objects.filter(batch=batch)
    ]

    for page in pages:
        assert "<script>alert" not in page
    assert any(
        "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page for page in pages
    )
