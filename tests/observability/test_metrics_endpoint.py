"""GET /metrics: off without a token, the bearer token's rules, answered by
address like the probes, and the worker API's request metrics."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.support.metrics import samples

pytestmark = pytest.mark.django_db

TOKEN = "scrape-9f8e7d6c5b4a"


@pytest.fixture
def token(settings) -> str:
    settings.RECALL_METRICS_TOKEN = TOKEN
    return TOKEN


def scrape(client: Client, authorization: str | None = f"Bearer {TOKEN}", **extra):
    if authorization is not None:
        extra["HTTP_AUTHORIZATION"] = authorization
    return client.get("/metrics", **extra)


def test_metrics_are_off_without_a_token(settings, client):
    settings.RECALL_METRICS_TOKEN = ""

    assert scrape(client).status_code == 404
    assert scrape(client, None).status_code == 404


def test_metrics_need_the_bearer_token(token, client):
    refused = [
        None,
        "",
        "Bearer",
        "Bearer wrong",
        f"Basic {TOKEN}",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Bearer {TOKEN.upper()}",
        "Bearer \u00e9\u00fc\udcff",  # not ASCII, a lone surrogate: still a 401
    ]
    for authorization in refused:
        response = scrape(client, authorization)
        assert response.status_code == 401, authorization
        assert response["WWW-Authenticate"] == 'Bearer realm="recall-metrics"'
        assert b"recall_jobs" not in response.content

    response = scrape(client, f"bearer  {TOKEN} ")

    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert response["Cache-Control"] == "no-store"
    assert 'recall_jobs{status="queued"} 0.0' in response.content.decode()


def test_metrics_are_get_only(token, client):
    response = client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")

    assert response.status_code == 405
    assert response["Allow"] == "GET"


def test_metrics_answer_by_address_and_over_plain_http(token, client, settings):
    """Prometheus scrapes each node by its address, like the probes."""
    settings.SECURE_SSL_REDIRECT = True

    assert scrape(client, HTTP_HOST="10.1.2.3:8000").status_code == 200
    settings.RECALL_METRICS_TOKEN = ""
    assert scrape(client, HTTP_HOST="10.1.2.3:8000").status_code == 400


def test_worker_api_requests_and_claim_times_are_counted(token, api, batch):
    metrics = Client()
    before = samples(scrape(metrics).content)

    claimed = api.claim()
    job = claimed.json()["job"]
    assert api.heartbeat(job["id"], job["lease_token"]).status_code == 200
    assert api.heartbeat_many([(job["id"], job["lease_token"])]).status_code == 200
    assert api.post("/api/v1/heartbeat", {"leases": []}).status_code == 400
    assert api.complete(job["id"], job["lease_token"]).status_code == 200
    replayed = api.complete_many([(job["id"], job["lease_token"], {"text": "x"})])
    assert replayed.status_code == 200
    assert api.heartbeat(job["id"], job["lease_token"]).status_code == 409
    assert api.post("/api/v1/claim", raw=b"[1]").status_code == 400
    assert api.post("/api/v1/claim", {}, token="not-a-worker-token").status_code == 401
    assert Client().get("/api/v1/claim").status_code == 405
    after = samples(scrape(metrics).content)

    def delta(key: tuple) -> float:
        return after.get(key, 0) - before.get(key, 0)

    requests = {
        (key[1][1], key[2][1]): delta(key)
        for key in after
        if key[0] == "recall_api_requests_total" and delta(key)
    }
    assert requests == {
        ("claim", "200"): 1,
        ("heartbeat", "200"): 1,
        ("heartbeat_many", "200"): 1,
        ("heartbeat_many", "400"): 1,
        ("complete", "200"): 1,
        ("complete_many", "200"): 1,
        ("heartbeat", "409"): 1,
        ("claim", "400"): 1,
        ("claim", "401"): 1,
        ("claim", "405"): 1,
    }
    assert delta(("recall_claim_seconds_count",)) == 4
    assert delta(("recall_claim_seconds_bucket", ("le", "+Inf"))) == 4
    assert delta(("recall_claim_seconds_sum",)) > 0
