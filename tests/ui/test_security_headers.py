"""Every page an operator sees carries a Content-Security-Policy that allows no
inline script and no inline style, and no page needs one."""

import re

import pytest
from django.test import Client
from django.utils import timezone

from jobs import transitions
from tests.support.factories import claim, make_batch, make_user

pytestmark = pytest.mark.django_db

POLICY = {
    "default-src": "'self'",
    "script-src": "'self'",
    "style-src": "'self'",
    "img-src": "'self'",
    "connect-src": "'self'",
    "form-action": "'self'",
    "frame-ancestors": "'none'",
    "base-uri": "'none'",
    "object-src": "'none'",
}


def policy(response) -> dict[str, str]:
    """The Content-Security-Policy header as {directive: sources}."""
    directives = (
        d.strip().split(" ", 1) for d in response["Content-Security-Policy"].split(";")
    )
    return {name: sources for name, sources in directives}


@pytest.fixture
def pages(worker) -> dict[str, str]:
    batch = make_batch(3)
    job = claim(worker, now=timezone.now())
    transitions.complete(job, job.lease_token, worker=worker, result={"text": "hi"})
    return {
        "list": "/",
        "list fragment": "/batches/live",
        "batch": f"/batches/{batch.pk}/",
        "batch fragment": f"/batches/{batch.pk}/live",
        "items fragment": f"/batches/{batch.pk}/items/live",
        "item": f"/items/{job.item_id}/",
        "workers": "/workers/",
        "new batch": "/batches/new/",
        "admin": "/admin/",
        "admin jobs": "/admin/jobs/job/",
        "admin job": f"/admin/jobs/job/{job.pk}/change/",
    }


def test_every_page_has_the_policy_and_no_inline_style_or_script(pages):
    client = Client()
    client.force_login(make_user("root", superuser=True))

    for name, path in pages.items():
        response = client.get(path)
        assert response.status_code in (200, 286), name
        assert policy(response) == POLICY, name
        html = response.content.decode()
        assert not re.search(r"\sstyle=", html), name
        assert not re.search(r"<style", html), name
        assert not re.search(r"<script(?![^>]*\ssrc=)(?![^>]*type=\"application/json\")", html), name  # fmt: skip
        assert not re.search(r"\son[a-z]+=", html), name  # no inline handlers


def test_the_login_page_has_it_too():
    response = Client().get("/accounts/login/")

    assert policy(response) == POLICY
    assert "unsafe-inline" not in response["Content-Security-Policy"]


def test_the_worker_api_answers_without_a_policy(api):
    response = api.claim()

    assert "Content-Security-Policy" not in response
