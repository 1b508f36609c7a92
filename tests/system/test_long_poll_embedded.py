"""Long-poll claims on whichever database the suite runs on: on the embedded
SQLite default too (``make run``), the real server holds a waiting claim,
its probe (plain ORM) wakes it when a batch comes, and a wait that finds
nothing ends with 204. The PostgreSQL-only details are in
test_long_poll_server.py."""

from __future__ import annotations

import pytest

from tests.support.factories import make_worker
from tests.support.long_poll import post, woken_by_a_new_batch
from tests.support.server import start_server

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_waiting_claim_is_woken_by_a_batch_and_a_fruitless_one_ends_204(tmp_path):
    process, port, log = start_server(tmp_path, 2, 4)
    try:
        woken_by_a_new_batch(port)  # within 2 s of the batch

        status, body, took = post(
            port, make_worker("idle"), "claim", {"wait_seconds": 1.5}
        )
        assert (status, body) == (204, None)
        assert 1.5 <= took < 5
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "Traceback" not in log.read_text()
