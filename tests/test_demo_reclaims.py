"""The demo's terminal reports every reclaim once (issue 27, item 7), also a
lease reclaimed after a newer one: leases are numbered when claimed, reclaimed
when they expire."""

from __future__ import annotations

import importlib.util
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from jobs import transitions
from tests.support.factories import make_batch, make_worker

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"


def _demo():
    spec = importlib.util.spec_from_file_location("recall_demo", DEMO)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def test_a_lease_reclaimed_after_a_newer_one_is_reported(settings):
    settings.RECALL_LEASE_SECONDS = 15
    make_batch(4, now=transitions.now() - timedelta(minutes=5))
    flaky = make_worker("gpu-flaky")
    now = transitions.now()
    old = transitions.claim_next(flaky, now=now - timedelta(seconds=60))
    new = transitions.claim_next(flaky, now=now - timedelta(seconds=60))
    # The newer lease stops heartbeating first: it is reclaimed first.
    transitions.heartbeat(
        old, old.lease_token, worker=flaky, now=now - timedelta(seconds=50)
    )
    watch = _demo().ReclaimWatch()
    assert watch.new_lines() == []

    transitions.reclaim_expired(now=now - timedelta(seconds=40))
    first = watch.new_lines()
    transitions.reclaim_expired(now=now - timedelta(seconds=30))
    second = watch.new_lines()

    assert first == [
        f"reclaimed job {new.pk}: gpu-flaky's lease (attempt 1) expired; queued again"
    ]
    assert second == [
        f"reclaimed job {old.pk}: gpu-flaky's lease (attempt 1) expired; queued again"
    ]
    assert watch.new_lines() == []  # each once
