"""Each action is gated by its own permission: without it there is no option
for it on the page, and a forged POST is refused and changes nothing."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.utils import timezone

from batches.models import BatchItem, ItemStatus
from jobs import transitions
from jobs.models import Event
from tests.support.admin import JOBS, VIEW_ALL, WORKERS, act, messages_of, permission
from tests.support.factories import jobs_of, make_batch, snapshot

pytestmark = pytest.mark.django_db

JOB_ACTIONS = {
    "force_reclaim": "jobs.force_reclaim",
    "requeue_failed": "jobs.requeue_job",
    "cancel_queued": "jobs.cancel_job",
    "run_reconcile": "jobs.run_reconcile",
}


def _every_kind_of_job(worker):
    """A leased, a failed, a queued job, and an item out of line with its job
    (what reconciliation would heal): something for every action to change."""
    batch = make_batch(4)
    now = timezone.now()
    transitions.claim_next(worker, now=now)
    failed = transitions.claim_next(worker, now=now)
    transitions.fail(
        failed, failed.lease_token, worker=worker, error="e", retryable=False
    )
    drifted = jobs_of(batch)[-1]
    BatchItem.objects.filter(pk=drifted.item_id).update(status=ItemStatus.DONE)
    return jobs_of(batch)


@pytest.mark.parametrize("action", JOB_ACTIONS)
def test_without_its_permission_an_action_is_not_offered_and_a_forged_post_fails(
    action, staff, worker
):
    jobs = _every_kind_of_job(worker)
    others = [p for a, p in JOB_ACTIONS.items() if a != action]
    _, client = staff("almost", "jobs.view_job", *others)
    before = snapshot(*jobs)

    page = client.get(JOBS)

    assert page.status_code == 200
    offered = [
        value for value, _ in page.context["action_form"].fields["action"].choices
    ]
    assert offered == ["", *(a for a in JOB_ACTIONS if a != action)]
    assert f'value="{action}"'.encode() not in page.content

    for confirm in (False, True):
        response = act(client, action, [j.pk for j in jobs], confirm=confirm)
        assert response.status_code == 302
        assert messages_of(response) == ["No action selected."]
        client.get(response["Location"])  # shows (and so clears) the message

    assert snapshot(*jobs) == before
    assert not Event.objects.exists()
    assert not LogEntry.objects.exists()


def test_a_viewer_gets_no_actions_at_all_and_cannot_force_one(staff, worker):
    jobs = _every_kind_of_job(worker)
    _, client = staff("viewer", "jobs.view_job")
    before = snapshot(*jobs)

    page = client.get(JOBS)

    assert page.status_code == 200
    assert page.context["action_form"] is None
    assert b'name="action"' not in page.content
    for action in JOB_ACTIONS:
        response = act(client, action, [j.pk for j in jobs], confirm=True)
        # No action exists for this user: the POST is just a list page view.
        assert response.status_code == 200
        assert messages_of(response) == []
    assert snapshot(*jobs) == before
    assert not Event.objects.exists()
    assert not LogEntry.objects.exists()


def test_an_action_permission_without_view_permission_opens_nothing(staff, worker):
    jobs = _every_kind_of_job(worker)
    _, client = staff("blind", *JOB_ACTIONS.values())
    before = snapshot(*jobs)

    assert client.get(JOBS).status_code == 403
    response = act(client, "force_reclaim", [j.pk for j in jobs], confirm=True)

    assert response.status_code == 403
    assert snapshot(*jobs) == before
    assert not Event.objects.exists()


def test_users_who_are_not_staff_are_sent_to_the_login_page(django_user_model, client):
    user = django_user_model.objects.create_user("outsider")
    user.user_permissions.set([permission(p) for p in VIEW_ALL])
    client.force_login(user)

    response = client.get(JOBS)

    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


@pytest.mark.parametrize(
    ("action", "needs"),
    [
        ("disable_workers", "jobs.disable_worker"),
        ("enable_workers", "jobs.disable_worker"),
        ("rotate_tokens", "jobs.rotate_worker_token"),
    ],
)
def test_worker_actions_need_their_permission(action, needs, staff, worker):
    others = {"jobs.disable_worker", "jobs.rotate_worker_token"} - {needs}
    _, client = staff("almost", "jobs.view_worker", "jobs.change_worker", *others)
    transitions.set_worker_active(worker, action != "enable_workers")
    before = list(type(worker).objects.values())

    page = client.get(WORKERS)
    response = act(client, action, [worker.pk], confirm=True, url=WORKERS)

    assert f'value="{action}"'.encode() not in page.content
    assert response.status_code == 302
    assert messages_of(response) == ["No action selected."]
    assert list(type(worker).objects.values()) == before
    assert not LogEntry.objects.exists()
