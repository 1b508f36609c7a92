"""Webhook endpoints and deliveries: their writes, each a short transaction.

Events themselves are written by the transitions that cause them
(``outbox.py``); here are the endpoints (create, rotate the secret, disable,
re-enable, a test event), the deliveries' attempts (claimed by compare-and-set
under a lease, then their outcome recorded), an operator's redelivery, and the
dispatcher's lease. ``engine.webhooks.delivery`` decides when to call them and makes the
HTTP requests, never inside a transaction.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q

from jobs.models import (
    DeliveryStatus,
    WebhookAttempt,
    WebhookDelivery,
    WebhookDispatch,
    WebhookEndpoint,
    WebhookEvent,
    WebhookEventType,
)
from jobs.webhook_keys import (
    SecretUnreadable,
    decrypt,
    encrypt,
    is_current,
    new_secret,
    reencrypt,
)

from .outbox import emit, enqueue_on_commit

INTERRUPTED = (
    "Interrupted: the process sending it stopped before an answer was recorded "
    "(its lease ran out); the attempt was made again."
)
GONE = "The endpoint answered 410 Gone: it was disabled."
# Longest error or response text kept per attempt.
MAX_TEXT = 2_000


def _clean(text: str) -> str:
    """PostgreSQL text holds no NUL; keep diagnostics short."""
    return text.replace("\x00", "\ufffd")[:MAX_TEXT]


# --- Endpoints ---------------------------------------------------------------------


def create_endpoint(
    url: str, *, events: Sequence[str], description: str = "", now: datetime
) -> tuple[WebhookEndpoint, str]:
    """A new endpoint and its secret (returned once; stored encrypted). The
    caller has checked the URL and the event types."""
    secret = new_secret()
    endpoint = WebhookEndpoint.objects.create(
        url=url,
        events=",".join(events),
        description=description,
        secret_encrypted=encrypt(secret),
        created_at=now,
    )
    return endpoint, secret


def rotate_secret(endpoint_id: int, *, now: datetime) -> str:
    """Give the endpoint a new secret (returned once). The old one is still
    signed with for ``RECALL_WEBHOOK_ROTATION_HOURS``."""
    secret = new_secret()
    with transaction.atomic():
        endpoint = WebhookEndpoint.objects.select_for_update().get(pk=endpoint_id)
        try:
            previous = encrypt(decrypt(endpoint.secret_encrypted))
        except SecretUnreadable:
            previous = ""  # unusable anyway: nothing to keep signing with
        hours = settings.RECALL_WEBHOOK_ROTATION_HOURS
        WebhookEndpoint.objects.filter(pk=endpoint_id).update(
            secret_encrypted=encrypt(secret),
            previous_secret_encrypted=previous,
            previous_secret_expires_at=now + timedelta(hours=hours)
            if previous and hours
            else None,
        )
    return secret


@dataclass
class Reencrypted:
    """What ``reencrypt_secrets`` did, by endpoint id."""

    changed: list[int]  # now under the current SECRET_KEY (were under a fallback)
    current: list[int]  # already were
    unreadable: list[int]  # no key decrypts a secret of theirs: rotate them


def reencrypt_secrets() -> Reencrypted:
    """Re-encrypt every endpoint's secrets (the current one, and the previous
    one while a rotation lasts) under the current ``SECRET_KEY``, one endpoint
    per transaction under its row lock, so a concurrent rotation is not
    overwritten. Afterwards the keys in ``SECRET_KEY_FALLBACKS`` decrypt
    nothing Recall still needs. Idempotent."""
    report = Reencrypted(changed=[], current=[], unreadable=[])
    ids = list(WebhookEndpoint.objects.order_by("pk").values_list("pk", flat=True))
    for endpoint_id in ids:
        with transaction.atomic():
            endpoint = (
                WebhookEndpoint.objects.select_for_update()
                .filter(pk=endpoint_id)
                .first()
            )
            if endpoint is None:
                continue
            stored = {
                "secret_encrypted": endpoint.secret_encrypted,
                "previous_secret_encrypted": endpoint.previous_secret_encrypted,
            }
            stale = {k: v for k, v in stored.items() if v and not is_current(v)}
            if not stale:
                report.current.append(endpoint_id)
                continue
            try:
                fresh = {k: reencrypt(v) for k, v in stale.items()}
            except SecretUnreadable:
                report.unreadable.append(endpoint_id)
                continue
            WebhookEndpoint.objects.filter(pk=endpoint_id).update(**fresh)
            report.changed.append(endpoint_id)
    return report


def signing_secrets(endpoint: WebhookEndpoint, *, now: datetime) -> list[str]:
    """The secrets to sign with: the current one, and the previous one while
    its rotation period lasts."""
    found = [decrypt(endpoint.secret_encrypted)]
    until = endpoint.previous_secret_expires_at
    if endpoint.previous_secret_encrypted and until is not None and until > now:
        found.append(decrypt(endpoint.previous_secret_encrypted))
    return found


def set_endpoint_active(
    endpoint_id: int, active: bool, *, reason: str = "", now: datetime
) -> bool:
    """Disable (deliveries wait) or re-enable (they resume at once) an
    endpoint. False if it already was."""
    with transaction.atomic():
        changed = WebhookEndpoint.objects.filter(
            pk=endpoint_id, is_active=not active
        ).update(is_active=active, disabled_reason="" if active else reason)
        if changed and active:
            enqueue_on_commit(
                list(
                    WebhookDelivery.objects.filter(endpoint_id=endpoint_id)
                    .due(now)
                    .values_list("pk", flat=True)
                )
            )
    return bool(changed)


def send_test_event(endpoint: WebhookEndpoint, *, now: datetime) -> WebhookEvent:
    """A ``webhook.test`` event for this one endpoint."""
    with transaction.atomic():
        return emit(
            WebhookEventType.TEST,
            {
                "endpoint": {"id": endpoint.pk, "url": endpoint.url},
                "message": "A test event from Recall's admin.",
            },
            now=now,
            endpoints=[endpoint],
        )


def redeliver(event_ids: Iterable[int], *, now: datetime) -> int:
    """Send events again now: each delivery (delivered, given up or waiting)
    becomes due at once, and endpoints that subscribed since get one too. An
    attempt in flight is left to finish. Returns how many deliveries."""
    total = 0
    for event_id in sorted(set(event_ids)):
        with transaction.atomic():
            event = WebhookEvent.objects.select_for_update().filter(pk=event_id).first()
            if event is None:
                continue
            WebhookDelivery.objects.filter(event=event).filter(
                Q(lease_token__isnull=True) | Q(leased_until__lt=now)
            ).update(
                status=DeliveryStatus.PENDING,
                next_attempt_at=now,
                finished_at=None,
                lease_token=None,
                leased_until=None,
            )
            if event.type != WebhookEventType.TEST:
                have = set(
                    WebhookDelivery.objects.filter(event=event).values_list(
                        "endpoint_id", flat=True
                    )
                )
                WebhookDelivery.objects.bulk_create(
                    WebhookDelivery(
                        event=event, endpoint=e, next_attempt_at=now, created_at=now
                    )
                    for e in WebhookEndpoint.objects.subscribed_to(event.type)
                    if e.pk not in have
                )
            ids = list(
                WebhookDelivery.objects.filter(event=event)
                .due(now)
                .values_list("pk", flat=True)
            )
            enqueue_on_commit(ids)
        total += len(ids)
    return total


# --- Attempts ------------------------------------------------------------------


@dataclass(frozen=True)
class Claimed:
    """An attempt this process may make: the delivery (with its event and
    endpoint), the lease's token and the attempt's number."""

    delivery: WebhookDelivery
    token: str
    number: int


def claim_deliveries(
    *,
    now: datetime,
    limit: int,
    lease: timedelta,
    ids: Sequence[int] | None = None,
) -> list[Claimed]:
    """Take up to ``limit`` due deliveries (of ``ids`` only, if given), each
    by compare-and-set under a lease of its own, so two processes never make
    the same attempt at once. Writes each attempt's row."""
    due = WebhookDelivery.objects.due(now)
    if ids is not None:
        due = due.filter(pk__in=ids)
    claimed = []
    for pk in due.order_by("next_attempt_at", "pk").values_list("pk", flat=True)[
        :limit
    ]:
        token = secrets.token_hex(16)
        with transaction.atomic():
            # Compare-and-set on the row's own columns (no join: PostgreSQL
            # re-checks them on the row another claim may have just changed).
            taken = (
                WebhookDelivery.objects.filter(
                    pk=pk, status=DeliveryStatus.PENDING, next_attempt_at__lte=now
                )
                .filter(Q(leased_until__isnull=True) | Q(leased_until__lt=now))
                .update(
                    lease_token=token,
                    leased_until=now + lease,
                    attempts=F("attempts") + 1,
                )
            )
            if not taken:
                continue  # another process took it first
            delivery = WebhookDelivery.objects.select_related("event", "endpoint").get(
                pk=pk
            )
            WebhookAttempt.objects.filter(
                delivery_id=pk, finished_at__isnull=True
            ).update(error=INTERRUPTED)
            WebhookAttempt.objects.create(
                delivery_id=pk, number=delivery.attempts, started_at=now
            )
        claimed.append(Claimed(delivery, token, delivery.attempts))
    return claimed


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to. ``status_code`` None: no HTTP answer."""

    status_code: int | None
    duration_ms: int
    excerpt: str = ""
    error: str = ""

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def record_attempt(claimed: Claimed, outcome: Outcome, *, now: datetime) -> str | None:
    """Write the attempt's outcome and move the delivery on: delivered (2xx),
    given up (410, which also disables the endpoint; or out of attempts), or
    due again after the next delay of ``RECALL_WEBHOOK_RETRY_SECONDS``.
    Returns the delivery's new status, or None if this process's lease was
    lost meanwhile (another took the delivery over)."""
    error = _clean(outcome.error)
    delays = settings.RECALL_WEBHOOK_RETRY_SECONDS
    with transaction.atomic():
        WebhookAttempt.objects.filter(
            delivery_id=claimed.delivery.pk, number=claimed.number
        ).update(
            finished_at=now,
            duration_ms=outcome.duration_ms,
            status_code=outcome.status_code,
            response_excerpt=_clean(outcome.excerpt),
            error=error,
        )
        mine = WebhookDelivery.objects.filter(
            pk=claimed.delivery.pk,
            lease_token=claimed.token,
            status=DeliveryStatus.PENDING,
        )
        fields: dict[str, Any] = {
            "lease_token": None,
            "leased_until": None,
            "last_status_code": outcome.status_code,
        }
        if outcome.delivered:
            status = DeliveryStatus.DELIVERED
            fields.update(next_attempt_at=None, finished_at=now, last_error="")
        elif outcome.status_code == 410:
            status = DeliveryStatus.FAILED
            fields.update(next_attempt_at=None, finished_at=now, last_error=GONE)
        elif claimed.number > len(delays):
            status = DeliveryStatus.FAILED
            fields.update(
                next_attempt_at=None,
                finished_at=now,
                last_error=f"Gave up after {claimed.number} attempts. Last: {error}",
            )
        else:
            status = DeliveryStatus.PENDING
            fields.update(
                next_attempt_at=now + timedelta(seconds=delays[claimed.number - 1]),
                last_error=error,
            )
        if not mine.update(status=status, **fields):
            return None
        if outcome.status_code == 410:
            WebhookEndpoint.objects.filter(pk=claimed.delivery.endpoint_id).update(
                is_active=False, disabled_reason=f"{GONE} ({now.isoformat()})"
            )
    return status


# --- The dispatcher's lease -----------------------------------------------------------

# A successor a dispatcher queued but that has not started for this long (lost,
# or stuck behind long tasks) no longer keeps scheduled dispatchers away.
HANDOVER_STALE = timedelta(minutes=3)


def acquire_dispatcher(
    owner: str, *, now: datetime, ttl: timedelta, handover: str = ""
) -> bool:
    """Take (or extend) the dispatcher's lease, unless another owner holds it
    or a successor is awaited (``handover``: the awaited successor's token)."""
    WebhookDispatch.objects.get_or_create(pk=WebhookDispatch.SINGLETON)
    free = Q(locked_until__isnull=True) | Q(locked_until__lt=now) | Q(locked_by=owner)
    expected = Q(handover="") | Q(handover_at__lt=now - HANDOVER_STALE)
    if handover:
        expected |= Q(handover=handover)
    return bool(
        WebhookDispatch.objects.filter(pk=WebhookDispatch.SINGLETON)
        .filter(free, expected)
        .update(locked_until=now + ttl, locked_by=owner, handover="", handover_at=None)
    )


def hand_over_dispatcher(owner: str, token: str, *, now: datetime) -> bool:
    """Release the lease to the successor with ``token`` only."""
    return bool(
        WebhookDispatch.objects.filter(
            pk=WebhookDispatch.SINGLETON, locked_by=owner
        ).update(locked_until=None, locked_by="", handover=token, handover_at=now)
    )


def release_dispatcher(owner: str) -> None:
    WebhookDispatch.objects.filter(
        pk=WebhookDispatch.SINGLETON, locked_by=owner
    ).update(locked_until=None, locked_by="")
