"""Workers in the admin: the token is shown once at creation and at rotation,
never stored or shown again; disabling and re-enabling take effect at once."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType

from jobs import transitions
from jobs.models import Event, Job, Worker
from jobs.tokens import hash_token
from tests.support.admin import WORKERS, act, messages_of
from tests.support.factories import WorkerClient, make_batch, make_worker

pytestmark = pytest.mark.django_db


def _api(worker: Worker, token: str) -> WorkerClient:
    worker.token = token
    return WorkerClient(worker)


def _error(response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]


def _no_trace_of(token: str, client, user) -> None:
    """The token is nowhere a later request could find it."""
    assert token not in str(dict(client.session))
    assert token not in str(client.cookies)
    assert not LogEntry.objects.filter(change_message__contains=token).exists()
    assert not Worker.objects.filter(token_hash=token).exists()
    worker_page = client.get(WORKERS)
    assert token.encode() not in worker_page.content
    for worker in Worker.objects.all():
        page = client.get(f"{WORKERS}{worker.pk}/change/")
        assert page.status_code == 200
        assert token.encode() not in page.content


def test_creating_a_worker_shows_its_token_once(staff):
    user, client = staff("ops", "jobs.add_worker", "jobs.view_worker")

    form = client.get(f"{WORKERS}add/")
    response = client.post(f"{WORKERS}add/", {"name": "gpu-box-9"})

    assert list(form.context["adminform"].form.fields) == ["name"]
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    worker = Worker.objects.get(name="gpu-box-9")
    [(shown, token)] = response.context["tokens"]
    assert shown == worker
    assert token.encode() in response.content
    assert transitions.authenticate_worker(token)[0] == worker
    assert worker.token_hash == hash_token(token)
    assert _api(worker, token).claim().status_code == 204
    entry = LogEntry.objects.get(user=user)
    assert (entry.object_id, entry.action_flag) == (str(worker.pk), ADDITION)
    _no_trace_of(token, client, user)


def test_a_worker_name_must_be_printable_and_unique(staff):
    make_worker("gpu-1")
    _, client = staff("ops", "jobs.add_worker", "jobs.view_worker")

    for name, error in [
        ("gpu-1", "Worker with this Name already exists."),
        ("bad\x07name", "Use 1 to 100 printable characters."),
    ]:
        response = client.post(f"{WORKERS}add/", {"name": name})
        assert response.status_code == 200
        assert response.context["adminform"].form.errors["name"] == [error]
    assert Worker.objects.count() == 1


def test_the_change_form_edits_the_name_and_nothing_else(staff, worker):
    _, client = staff("ops", "jobs.change_worker", "jobs.view_worker")
    before = Worker.objects.filter(pk=worker.pk).values().get()

    response = client.post(
        f"{WORKERS}{worker.pk}/change/",
        {
            "name": "gpu-renamed",
            "is_active": "",
            "token_prefix": "hijacked",
            "token_hash": "0" * 64,
        },
    )

    assert response.status_code == 302
    after = Worker.objects.filter(pk=worker.pk).values().get()
    assert after == {**before, "name": "gpu-renamed"}
    page = client.get(f"{WORKERS}{worker.pk}/change/")
    assert list(page.context["adminform"].form.fields) == ["name"]
    assert worker.token_hash.encode() not in page.content


def test_disable_then_re_enable_take_effect_at_once_and_are_audited(staff, worker, api):
    make_batch(1)
    job = api.claim().json()["job"]
    user, client = staff("ops", "jobs.view_worker", "jobs.disable_worker")

    page = act(client, "disable_workers", [worker.pk], confirm=False, url=WORKERS)

    confirmation = page.context["confirmation"]
    assert confirmation.summary == "Disable the selected workers."
    assert confirmation.counts == [
        ("Workers selected", 1),
        ("Disabled", 1),
        ("Skipped: already disabled", 0),
    ]
    assert confirmation.sample == [
        f'<a href="/admin/jobs/worker/{worker.pk}/change/">gpu-1 (holds 1 live '
        f"lease)</a>"
    ]
    assert Worker.objects.get(pk=worker.pk).is_active is True

    response = act(client, "disable_workers", [worker.pk], confirm=True, url=WORKERS)

    assert messages_of(response) == ["Disabled 1 worker."]
    assert Worker.objects.get(pk=worker.pk).is_active is False
    assert _error(api.heartbeat(job["id"], job["lease_token"])) == (403, "forbidden")
    assert _error(api.claim()) == (403, "forbidden")
    # The lease it held is not ended by this: it runs out and is reclaimed.
    assert Job.objects.get(pk=job["id"]).status == "leased"

    client.get(response["Location"])
    response = act(client, "enable_workers", [worker.pk], confirm=True, url=WORKERS)

    assert messages_of(response) == ["Re-enabled 1 worker."]
    assert api.heartbeat(job["id"], job["lease_token"]).status_code == 200
    assert list(
        LogEntry.objects.filter(user=user)
        .order_by("pk")
        .values_list("object_id", "action_flag", "change_message")
    ) == [
        (str(worker.pk), CHANGE, "Disabled: its requests get 403."),
        (str(worker.pk), CHANGE, "Re-enabled."),
    ]


def test_disabling_a_disabled_worker_changes_nothing(staff, worker, other_worker):
    transitions.set_worker_active(worker, False)
    user, client = staff("ops", "jobs.view_worker", "jobs.disable_worker")
    ids = [worker.pk, other_worker.pk]

    page = act(client, "disable_workers", ids, confirm=False, url=WORKERS)
    response = act(client, "disable_workers", ids, confirm=True, url=WORKERS)

    assert page.context["confirmation"].counts == [
        ("Workers selected", 2),
        ("Disabled", 1),
        ("Skipped: already disabled", 1),
    ]
    assert messages_of(response) == [
        "Disabled 1 worker.",
        "Skipped 1 worker: already disabled.",
    ]
    assert [e.object_id for e in LogEntry.objects.filter(user=user)] == [
        str(other_worker.pk)
    ]


def test_rotating_a_token_shows_the_new_one_once_and_the_old_one_stops(
    staff, worker, api
):
    old = worker.token
    user, client = staff("ops", "jobs.view_worker", "jobs.rotate_worker_token")

    page = act(client, "rotate_tokens", [worker.pk], confirm=False, url=WORKERS)
    assert page.context["confirmation"].counts == [("Workers selected: new tokens", 1)]
    assert transitions.authenticate_worker(old)[0] == worker  # nothing rotated yet

    response = act(client, "rotate_tokens", [worker.pk], confirm=True, url=WORKERS)

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    [(shown, new)] = response.context["tokens"]
    assert (shown.pk, new != old) == (worker.pk, True)
    assert _error(api.post("/api/v1/claim", {}, token=old)) == (401, "unauthorized")
    assert api.post("/api/v1/claim", {}, token=new).status_code == 204
    assert transitions.authenticate_worker(new)[0] == worker
    entry = LogEntry.objects.get(user=user)
    assert (entry.object_id, entry.change_message) == (
        str(worker.pk),
        "Rotated the token; the old one stopped working.",
    )
    _no_trace_of(new, client, user)


def test_only_a_worker_that_never_held_a_lease_can_be_deleted(staff, worker, api):
    make_batch(1)
    api.claim()
    unused = make_worker("typo-name")
    _, client = staff(
        "ops", "jobs.view_worker", "jobs.delete_worker", "jobs.change_worker"
    )

    refused = client.post(f"{WORKERS}{worker.pk}/delete/", {"post": "yes"})
    deleted = client.post(f"{WORKERS}{unused.pk}/delete/", {"post": "yes"})

    assert refused.status_code == 403
    assert Worker.objects.filter(pk=worker.pk).exists()
    assert deleted.status_code == 302
    assert not Worker.objects.filter(pk=unused.pk).exists()
    # No bulk delete: it would list every ledger row of every selected worker.
    page = client.get(WORKERS)
    assert b'value="delete_selected"' not in page.content


def test_disable_and_reclaim_stops_a_worker_and_hands_its_jobs_out_at_once(
    staff, worker, other_worker, api
):
    make_batch(3)
    held = [api.claim().json()["job"] for _ in range(2)]
    user, client = staff(
        "ops", "jobs.view_worker", "jobs.disable_worker", "jobs.force_reclaim"
    )

    page = act(client, "disable_and_reclaim", [worker.pk], confirm=False, url=WORKERS)

    assert page.context["confirmation"].counts == [
        ("Workers selected: disabled", 1),
        ("Their live leases: force-reclaimed", 2),
    ]
    assert Worker.objects.get(pk=worker.pk).is_active is True

    response = act(
        client, "disable_and_reclaim", [worker.pk], confirm=True, url=WORKERS
    )

    assert messages_of(response) == [
        "Disabled 1 worker; 2 live lease(s) reclaimed and their jobs queued again."
    ]
    assert Worker.objects.get(pk=worker.pk).is_active is False
    for job in held:
        assert Job.objects.get(pk=job["id"]).status == "queued"
        assert _error(api.heartbeat(job["id"], job["lease_token"])) == (
            403,
            "forbidden",
        )
    # Another worker takes them at once (the attempts were refunded).
    again = transitions.claim_next(other_worker)
    assert again is not None and again.attempts == 1
    assert list(
        LogEntry.objects.filter(
            user=user,
            object_id=str(worker.pk),
            content_type=ContentType.objects.get_for_model(Worker),
        ).values_list("change_message", flat=True)
    ) == [
        "Disabled and reclaimed 2 live lease(s): its requests get 403, its jobs "
        "are queued again."
    ]
    assert (
        LogEntry.objects.filter(
            user=user,
            change_message__startswith="Force reclaim: the worker was disabled",
        ).count()
        == 2
    )
    assert (
        Event.objects.filter(kind=Event.Kind.FORCE_RECLAIMED, actor=user).count() == 2
    )


def test_disable_and_reclaim_needs_both_permissions(staff, worker):
    _, client = staff("half", "jobs.view_worker", "jobs.disable_worker")

    listing = client.get(WORKERS)

    assert b'value="disable_and_reclaim"' not in listing.content
    act(client, "disable_and_reclaim", [worker.pk], confirm=True, url=WORKERS)
    assert Worker.objects.get(pk=worker.pk).is_active is True
