"""The two transition backends write the same rows.

Every program below runs twice on PostgreSQL from identical starting rows:
through the statement backend (``auto``) and through the portable ORM backend
(``orm``). After every operation the answers and every row of jobs, items,
ledger, counters, throughput buckets, events, tallies, batches and workers
must be equal (tokens and webhook ids normalised; tallies and throughput
buckets compared by their keys, not their ids), including the webhook outbox
(events and deliveries). The named cases cover every transition and
the unusual paths (stale tokens, a batched heartbeat's mixed answers, replays, backoff, the last attempt, forced
reclaim, cancel mid-flight, retry, drifted rows healed on the way) and
worker authentication (one token and a wave of them); the Hypothesis state
machine then tries sequences nobody thought of.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from .differential import _APPLY, BACKENDS, ITEM_STATUSES, first_difference, run

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

CASES = {
    "claim, heartbeat, complete, replay": [
        ("claim", 0),
        ("tick", 20),
        ("heartbeat", 0),
        ("tick", 30),
        ("complete", 0),
        ("complete", 0, "replayed"),
        ("claim", 1),
        ("complete", 1),
    ],
    "quality flags: empty, short, language mismatch, then a recount": [
        # b1 (priority 5) is claimed first, then b0 (timed, languages) and b2.
        *(("claim", n % 3) for n in range(9)),
        ("complete", 0, ""),
        ("complete", 1, "one two three", "fr"),
        ("complete", 3, "t", "de"),
        ("complete", 4, "", "en"),
        ("complete", 5, " ".join(["w"] * 30), "DE"),
        ("complete", 6, "t"),
        ("complete", 8, "", "fr"),
        ("reconcile",),
    ],
    "stale token after reclaim is fenced": [
        ("claim", 0),
        ("tick", 61),
        ("claim", 1),
        ("complete", 0),
        ("heartbeat", 0),
        ("release", 0),
        ("fail", 0, True),
        ("heartbeat", 1, 2),
        ("complete", 1),
    ],
    "batched heartbeat: renewed, lost, unknown, fenced, all in one call": [
        ("claim", 0),
        ("claim", 0),
        ("claim", 1),
        ("claim", 0),
        ("tick", 20),
        ("heartbeat_many", [0, 1, 3], None, True),
        ("complete", 1),
        ("heartbeat_many", [3, 1, 2, 0], None, True),  # 2: another worker's
        ("heartbeat_many", [0, 3], 2),  # a stranger renews nothing
        ("tick", 70),  # 2 expired; 0 and 3 expired but live until reclaimed
        ("heartbeat_many", [0, 3]),
        ("reclaim",),
        ("claim", 2),
        ("heartbeat_many", [2], 2),  # the old token, fenced by the new lease
        ("heartbeat_many", [4]),  # the new lease
        ("heartbeat_many", [], None, True),
        ("release", 4),
        ("heartbeat_many", [4, 0]),
    ],
    "batched completion: completed, replayed, lost, unknown, flagged, finished": [
        ("claim_many", 0, 3),  # b1 (priority 5, alone): one statement
        ("claim", 1),
        ("complete_many", [0, 1], None, True),
        ("complete_many", [1, 0], None, True),  # replays: completed, unchanged
        ("complete_many", [2, 3]),  # 3's holder's call: 2 is another's lease
        ("complete_many", [2], 1),  # a stranger completes nothing
        ("complete_many", [2]),  # its holder does: b1's last, its tail
        ("claim_many", 2, 32),  # b0 and b2 share out (rivals): single claims
        ("tick", 61),
        ("complete_many", [4, 5]),  # expired, not reclaimed: still live
        ("reclaim",),
        ("claim_many", 0, 2),  # the chores first: single claims
        ("complete_many", [6, 7, 8, 9, 10, 11, 12, 13]),  # the batches' tails
        ("complete_many", [], None, True),
    ],
    "batched completion: a batch in its tail and one that is not": [
        *[("claim", 0)] * 5,  # b1's three (priority 5), then b0's first, b2's
        # Lease 4 (b2, a job still queued) is one statement's; lease 0 (b1,
        # nothing queued: its tail) the ORM code's, after it. Their throughput
        # buckets are the same rows as when both are the ORM code's.
        ("complete_many", [4, 0]),
        ("complete_many", [1, 3, 2]),
    ],
    "claims of many: one statement, the cap, drifted and stray rows": [
        ("drift_item", 5, "transcribing"),  # b1's second job's item drifted
        ("stray_lease", 6, 2),  # and its third has an open ledger row
        ("cap", 2),
        ("claim_many", 0, 3),  # the cap leaves room for two
        ("claim_many", 0, 3),  # at the cap: refused
        ("cap", 32),
        ("claim_many", 1, 32),  # what is left, healed, then b0 and b2
        ("pause", 0),
        ("claim_many", 2, 4),
    ],
    "a claim of many heals a stray row in its place, as single claims would": [
        # Found by the state machine: the statement leased b1's first and
        # third jobs and the single claims after it the healed second, last.
        ("stray_lease", 5, 0),  # b1's second job has an open ledger row
        ("claim_many", 0, 32),  # 4, then 5 healed, 6, then b0 and b2 share
    ],
    "a claim of many whose first job drifted: single claims from the start": [
        ("drift_item", 4, "transcribing"),  # b1's first job's item drifted
        ("stray_lease", 6, 1),  # and its third has an open ledger row
        ("claim_many", 0, 3),  # 4 healed, 5, 6 healed
        ("claim_many", 1, 2),  # b0 and b2 share
    ],
    "retryable failure backs off, then the last attempt fails for good": [
        ("claim", 0),
        ("fail", 0, True),
        ("claim", 1),
        ("tick", 29),
        ("claim", 2),
        ("tick", 1),
        ("claim", 0),
        ("fail", 3, True),
        ("tick", 60),
        ("claim", 0),
        ("fail", 4, True),
        ("claim", 0),
        ("fail", 5, False),
    ],
    "expired leases on the last attempt give up": [
        *[("claim", w) for w in range(3)] * 3,
        ("tick", 61),
        ("reclaim",),
        *[("claim", w) for w in range(3)] * 3,
        ("tick", 61),
        ("sweep",),
        *[("claim", w) for w in range(3)] * 3,
        ("tick", 61),
        ("reclaim", 2),
        ("claim", 0),
        ("tick", 61),
        ("sweep",),
    ],
    "release refunds the attempt": [
        ("claim", 0),
        ("release", 0),
        ("claim", 1),
        ("release", 1),
        ("release", 1),
        ("claim", 2),
    ],
    "forced reclaim fences the old worker": [
        ("claim", 0),
        ("claim", 1),
        ("force", 0),
        ("force", 8),
        ("complete", 0),
        ("claim", 2),
        ("complete", 2),
    ],
    "cancel mid-flight, then a queued job and a queued selection": [
        ("claim", 0),
        ("claim", 1),
        ("claim", 2),
        ("cancel_batch", 1),
        ("complete", 0),
        ("cancel_job", 0),
        ("cancel_job", 5),
        ("cancel_queued", 0),
        ("cancel_batch", 1),
        ("settle",),
    ],
    "retry failed reopens a finished batch": [
        ("claim", 0),
        ("fail", 0, False),
        ("claim", 0),
        ("fail", 1, False),
        ("claim", 0),
        ("fail", 2, False),
        ("sweep",),
        ("retry", 1),
        ("claim", 0),
        ("complete", 3),
        ("retry", 0),
        ("retry", 1),
    ],
    "fair share: weights, a cap, a priority move, a resume": [
        ("share", 0, 0, 3, None),
        ("share", 2, 0, 1, 1),
        *[("claim", w % 3) for w in range(6)],
        ("complete", 0),
        ("claim", 1),
        ("share", 1, 0, 2, None),
        ("pause", 0),
        *[("claim", w % 3) for w in range(3)],
        ("resume", 0),
        ("share", 1, 0, 2, None),
        *[("claim", w % 3) for w in range(4)],
        ("complete", 2),
        ("claim", 0),
    ],
    "pause and resume": [
        ("pause", 1),
        ("claim", 0),
        ("pause", 1),
        ("resume", 1),
        ("resume", 1),
        ("claim", 0),
    ],
    "drifted rows are healed on the way": [
        ("drift_item", 2, "done"),
        ("claim", 0),
        ("stray_lease", 3, 1),
        ("claim", 0),
        ("drop_ledger_row", 0),
        ("complete", 0),
        ("claim", 1),
        ("drift_item", 0, "queued"),
        ("tick", 61),
        ("reclaim",),
        ("exhaust", 6),
        ("reconcile",),
        ("sweep",),
    ],
    "reconciliation repairs everything it finds": [
        ("claim", 0),
        ("claim", 1),
        ("drift_item", 4, "failed"),
        ("drop_ledger_row", 1),
        ("stray_lease", 7, 2),
        ("exhaust", 8),
        ("reconcile",),
        ("tick", 61),
        ("sweep",),
        ("claim", 2),
    ],
    "the last completions finish a batch once; a retry finishes it again": [
        *[("claim", w) for w in range(3)],
        ("complete", 0),
        ("complete", 1),
        ("fail", 2, False),
        ("claim", 0),
        ("claim", 1),
        ("complete", 3),
        ("complete", 4),
        ("complete", 3, "replayed"),
        ("sweep",),
        ("retry", 1),
        ("claim", 2),
        ("complete", 5),
        ("settle",),
    ],
    "a re-run queues ended items as a new run, routed by its requirement": [
        *[("claim", 0)] * 3,  # leases 0-2: batch 1's jobs (priority 5)
        ("complete", 0, ""),
        ("complete", 1),
        ("fail", 2, False),  # batch 1 finishes
        ("rerun", 1, "ended", 2),  # all three, requiring gpu=a100, model=large-v3
        ("rerun", 1, "all", 0),  # refused: they are queued now
        ("rerun", 1, "short", 1),  # nothing flagged any more
        ("claim", 0),  # lease 3: batch 0 (batch 1's jobs need labels)
        ("claim", 1, 1),  # lease 4: gpu=a100 alone is not enough either
        ("claim", 2, 2),  # lease 5: batch 1's first re-run job
        ("claim_many", 2, 3, 2),  # leases 6, 7: the other two
        ("release", 6),
        ("tick", 61),
        ("reclaim",),  # the re-run keeps its requirement when requeued
        ("claim", 0),  # lease 8: batch 0 again, never batch 1
        ("claim", 2, 2),  # lease 9
        ("cancel_job", 5),
        ("complete", 9, "a b c"),
        ("complete", 3, "t"),
        ("complete", 8, "t"),
        ("claim_many", 2, 3, 2),  # leases 10-12
        *[("complete", k, "t") for k in (10, 11, 12)],
        ("rerun", 0, "ended", 3),  # requiring gpu=h100: no worker offers it
        ("sweep",),
        ("reconcile",),
        ("cancel_batch", 1),
        ("rerun", 1, "ended", 0),  # batch_closed
    ],
    "expiry on the last attempt reports the item and finishes the batch": [
        *[("claim", w) for w in range(3)] * 2,
        ("tick", 61),
        ("reclaim",),
        *[("claim", w) for w in range(3)] * 2,
        ("tick", 61),
        ("reclaim",),
        *[("claim", w) for w in range(3)] * 2,
        ("tick", 61),
        ("reclaim", 2),
        ("sweep",),
    ],
    "worker tokens: held leases, a rotated token, a disabled worker": [
        ("authenticate",),
        ("claim", 0),
        ("claim", 0),
        ("claim", 1),
        ("authenticate",),
        ("rotate", 1),
        ("authenticate",),
        ("disable", 0),
        ("claim", 0),
        ("heartbeat", 0),
        ("authenticate",),
        ("enable", 0),
        ("enable", 0),
        ("claim", 0),
        ("complete", 3),
        ("authenticate",),
    ],
    "the lease cap: refused at it, room again after a completion or a reclaim": [
        ("cap", 2),
        ("claim", 0),
        ("claim", 0),
        ("claim", 0),  # refused by the one-statement claim
        ("authenticate",),
        ("claim", 1),
        ("complete", 0),
        ("claim", 0),  # room again
        ("claim", 0),
        ("share", 0, 0, 1, 3),  # batches with caps of their own: the ORM code
        ("share", 2, 0, 1, 3),
        ("claim", 2),
        ("claim", 2),
        ("claim", 2),  # refused on a capped batch's path
        ("cap", 0),
        ("claim", 1),  # refused with no lease held
        ("cap", 3),
        ("claim", 2),
        ("tick", 61),
        ("claim", 0),  # expired leases reclaimed first, then room
        ("claim", 0),
        ("claim", 0),
        ("claim", 0),
        ("release", 8),
        ("claim", 0),
        ("cancel_queued", 0),
        ("cancel_queued", 1),
        ("cancel_queued", 2),
        ("claim", 0),  # at the cap with nothing claimable: nothing, not refused
    ],
    "routing: labels, requirements, and many jobs in one claim": [
        ("require", 1, 1),  # the priority-5 batch needs a GPU
        ("claim", 0),  # no labels: a batch of priority 0
        ("claim", 1, 1),  # a GPU: the priority-5 batch
        ("cap", 2),
        ("claim_many", 2, 4, 2),  # two, then the cap ends the run
        ("claim_many", 2, 4, 2),  # at the cap with work left: refused
        ("cap", 32),
        ("require", 0, 2),
        ("require", 2, 3),  # nobody offers an h100
        ("claim", 0, 3),  # nothing it can serve
        ("claim_many", 1, 3, 1),  # nothing left that a GPU alone serves
        ("claim_many", 2, 3, 2),  # GPU and model: the rest of batch 0
        ("complete", 0),
        ("share", 0, 0, 2, 1),  # a capped batch: the ORM path
        ("require", 1, 0),
        ("tick", 61),
        ("claim_many", 0, 2, 0),  # expired leases reclaimed first
        ("require", 2, 0),
        ("claim_many", 2, 32, 1),
        ("disable", 1),
        ("claim_many", 1, 2),
    ],
    "requirements changed while open, refused once closed (issue 26)": [
        ("set_requires", 0, (("gpu", "a100"),)),
        ("set_requires", 0, (("gpu", "a100"),)),  # nothing to change
        ("claim", 0),
        ("set_requires", 0, (("gpu", "a100"), ("model", "large-v3"))),
        ("set_requires", 0, ()),
        ("cancel_batch", 1),
        ("set_requires", 1, (("gpu", "a100"),)),
        ("claim", 1),
    ],
}


def _assert_backends_agree(program) -> None:
    statements, orm = (run(program, backend) for backend in BACKENDS)
    assert first_difference(statements, orm) is None


@pytest.mark.parametrize("name", CASES)
def test_both_backends_write_the_same_rows(name):
    _assert_backends_agree(CASES[name])


def test_the_cases_reach_every_transition():
    # A case list that silently stopped covering a transition would prove little.
    used = {op[0] for program in CASES.values() for op in program}
    assert used == set(_APPLY)


class BackendsAgree(RuleBasedStateMachine):
    """Random programs: the rules write a program of operations (only from
    what Hypothesis draws, never from the database, so a failing program
    replays exactly), and the teardown runs it through both backends from
    identical rows and compares them after every step."""

    @initialize()
    def fresh_program(self):
        self.program: list = []

    def _do(self, *op):
        self.program.append(op)

    @rule(w=st.integers(0, 2), labels=st.none() | st.integers(0, 3))
    def claim(self, w, labels):
        self._do("claim", w, labels)

    @rule(
        w=st.integers(0, 2),
        n=st.sampled_from([1, 2, 3, 32]),
        labels=st.none() | st.integers(0, 3),
    )
    def claim_many(self, w, n, labels):
        self._do("claim_many", w, n, labels)

    @rule(b=st.integers(0, 2), r=st.integers(0, 3))
    def require(self, b, r):
        self._do("require", b, r)

    @rule(k=st.integers(0, 50), stranger=st.none() | st.integers(0, 2))
    def heartbeat(self, k, stranger):
        self._do("heartbeat", k, stranger)

    @rule(
        ks=st.lists(st.integers(0, 50), max_size=5),
        stranger=st.none() | st.integers(0, 2),
        unknown=st.booleans(),
    )
    def heartbeat_many(self, ks, stranger, unknown):
        self._do("heartbeat_many", ks, stranger, unknown)

    @rule(
        k=st.integers(0, 50),
        text=st.sampled_from(["t", "", "a b c"]),
        language=st.none() | st.sampled_from(["en", "de"]),
    )
    def complete(self, k, text, language):
        self._do("complete", k, text, language)

    @rule(
        ks=st.lists(st.integers(0, 50), max_size=5),
        stranger=st.none() | st.integers(0, 2),
        unknown=st.booleans(),
    )
    def complete_many(self, ks, stranger, unknown):
        self._do("complete_many", ks, stranger, unknown)

    @rule(k=st.integers(0, 50), retryable=st.booleans())
    def fail(self, k, retryable):
        self._do("fail", k, retryable)

    @rule(k=st.integers(0, 50))
    def release(self, k):
        self._do("release", k)

    @rule(seconds=st.sampled_from([1, 29, 30, 59, 61, 120]))
    def tick(self, seconds):
        self._do("tick", seconds)

    @rule(max_leases=st.sampled_from([0, 1, 2, 3, 32]))
    def cap(self, max_leases):
        self._do("cap", max_leases)

    @rule(limit=st.none() | st.integers(1, 3))
    def reclaim(self, limit):
        self._do("reclaim", limit)

    @rule()
    def sweep(self):
        self._do("sweep")

    @rule(j=st.integers(0, 8))
    def force(self, j):
        self._do("force", j)

    @rule(j=st.integers(0, 8))
    def cancel_job(self, j):
        self._do("cancel_job", j)

    @rule(b=st.integers(0, 2))
    def cancel_batch(self, b):
        self._do("cancel_batch", b)

    @rule(b=st.integers(0, 2))
    def cancel_queued(self, b):
        self._do("cancel_queued", b)

    @rule(b=st.integers(0, 2))
    def retry(self, b):
        self._do("retry", b)

    @rule(
        b=st.integers(0, 2),
        chosen=st.sampled_from(["all", "ended", "empty", "short"]),
        r=st.integers(0, 3),
    )
    def rerun(self, b, chosen, r):
        self._do("rerun", b, chosen, r)

    @rule(b=st.integers(0, 2), pause=st.booleans())
    def pause_or_resume(self, b, pause):
        self._do("pause" if pause else "resume", b)

    @rule(
        b=st.integers(0, 2),
        priority=st.sampled_from([0, 5]),
        weight=st.sampled_from([1, 2, 3, 1000]),
        cap=st.none() | st.integers(1, 3),
    )
    def share(self, b, priority, weight, cap):
        self._do("share", b, priority, weight, cap)

    @rule(j=st.integers(0, 8), status=st.sampled_from(ITEM_STATUSES))
    def drift_item(self, j, status):
        self._do("drift_item", j, status)

    @rule(j=st.integers(0, 8), w=st.integers(0, 2))
    def stray_lease(self, j, w):
        self._do("stray_lease", j, w)

    @rule(k=st.integers(0, 50))
    def drop_ledger_row(self, k):
        self._do("drop_ledger_row", k)

    @rule(j=st.integers(0, 8))
    def exhaust(self, j):
        self._do("exhaust", j)

    @rule()
    def reconcile(self):
        self._do("reconcile")

    @rule()
    def authenticate(self):
        self._do("authenticate")

    @rule(w=st.integers(0, 2))
    def rotate(self, w):
        self._do("rotate", w)

    @rule(w=st.integers(0, 2), enable=st.booleans())
    def disable_or_enable(self, w, enable):
        self._do("enable" if enable else "disable", w)

    @rule(
        b=st.integers(0, 2),
        pairs=st.sampled_from([(), (("gpu", "a100"),), (("model", "large-v3"),)]),
    )
    def set_requires(self, b, pairs):
        self._do("set_requires", b, pairs)

    def teardown(self):
        _assert_backends_agree(getattr(self, "program", []))


BackendsAgree.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_random_programs_write_the_same_rows = pytest.mark.slow(BackendsAgree.TestCase)


def test_the_outbox_cases_do_write_events():
    # A comparison of two empty outboxes would prove nothing.
    steps = run(
        CASES["the last completions finish a batch once; a retry finishes it again"],
        "auto",
    )
    events = steps[-1][2]["jobs_webhookevent"]
    finishes = sorted(
        (e["batch_id"], e["generation"])
        for e in events
        if e["type"] == "batch.finished"
    )
    assert (2, 1) in finishes and (2, 2) in finishes
    assert any(e["type"] == "item.failed" for e in events)
    assert len(steps[-1][2]["jobs_webhookdelivery"]) == len(events)
