"""Personal API tokens and the idempotency keys of batch submissions.

An API token belongs to a user and carries that user's permissions: what the
user may do in the operator UI, a pipeline holding the token may do over the
operator API. Only the token's SHA-256 is stored, with its first characters in
clear so it can be found without scanning every token (as worker tokens are,
``jobs.tokens``). The writes live in ``operator_api.tokens`` and
``operator_api.idempotency``.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

# "rct_" and the first characters of the random part: enough to find the row.
API_TOKEN_PREFIX_LENGTH = 12
MAX_LABEL_CHARS = 100
MAX_IDEMPOTENCY_KEY_CHARS = 255
# The longest expiry a token can be given (days); without one it never expires.
MAX_EXPIRY_DAYS = 3650
# How long a submission's Idempotency-Key returns the batch it created.
IDEMPOTENCY_TTL = timedelta(hours=24)


class ApiToken(models.Model):
    """A user's bearer token for the operator API (never a worker's)."""

    # Don't write last_used on every request: once per this many seconds is enough.
    LAST_USED_RESOLUTION = timedelta(seconds=60)

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    label = models.CharField(max_length=MAX_LABEL_CHARS, blank=True)
    token_prefix = models.CharField(max_length=API_TOKEN_PREFIX_LENGTH, db_index=True)
    token_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)
    last_used = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Refused from this moment on (null: never expires).
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API token"
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.label or 'token'} ({self.token_prefix}…)"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def used_long_ago(self, now: datetime) -> bool:
        """True when ``last_used`` is worth writing again (see the resolution)."""
        if self.last_used is None:
            return True
        return now - self.last_used >= self.LAST_USED_RESOLUTION


class IdempotencyKey(models.Model):
    """A submission's Idempotency-Key: for IDEMPOTENCY_TTL, the same key from the
    same user returns ``batch`` instead of creating another; ``body_hash`` tells
    a retry (same body) from a mistake (another body: a conflict)."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+"
    )
    key = models.CharField(max_length=MAX_IDEMPOTENCY_KEY_CHARS)
    body_hash = models.CharField(max_length=64)
    # Null only inside the transaction that creates the batch: the key is
    # inserted first, so a racing twin waits on it instead of doing the intake.
    batch = models.ForeignKey(
        "batches.Batch", null=True, on_delete=models.CASCADE, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "key"], name="idempotency_user_key")
        ]
        indexes = [models.Index(fields=["created_at"], name="idempotency_created")]

    def __str__(self) -> str:
        return self.key

    def expired(self, now: datetime) -> bool:
        return self.created_at <= now - IDEMPOTENCY_TTL
