from __future__ import annotations

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from ..factories import make_user


@pytest.fixture
def viewer_client(db) -> Client:
    client = Client()
    client.force_login(make_user("viewer", "Viewers"))
    return client


def samples(text: str | bytes) -> dict[tuple, float]:
    """Every sample of a scrape: {(name, (label, value), ...): value}."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def by_label(scrape: dict[tuple, float], name: str) -> dict[str, float]:
    """One labelled family of a scrape, by its only label's value."""
    return {key[1][1]: v for key, v in scrape.items() if key[0] == name}
