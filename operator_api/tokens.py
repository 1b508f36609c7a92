"""Writes and lookups of personal API tokens: issue (shown once), revoke, and
authenticate a request's bearer token.

A token is ``rct_`` and 43 random URL-safe characters; the prefix tells it
apart from a worker token at a glance (and in a secret scanner). It is hashed
like a worker token (``jobs.tokens.hash_token``); a revoked token is refused
from the moment the revocation commits, an expired one from its expiry on.
"""

from __future__ import annotations

import hmac
import secrets
from datetime import datetime, timedelta

from django.db.models import QuerySet

from jobs.tokens import MAX_TOKEN_LENGTH, hash_token

from .models import API_TOKEN_PREFIX_LENGTH, MAX_EXPIRY_DAYS, ApiToken

TOKEN_MARK = "rct_"


def issue_token(
    user, *, label: str = "", now: datetime, expires_in_days: int | None = None
) -> tuple[ApiToken, str]:
    """A new token for ``user``, refused after ``expires_in_days`` days if
    given (1 to MAX_EXPIRY_DAYS); the clear token is returned here only."""
    if expires_in_days is not None and not 1 <= expires_in_days <= MAX_EXPIRY_DAYS:
        raise ValueError(
            f"An expiry is a whole number of days from 1 to {MAX_EXPIRY_DAYS}."
        )
    token = TOKEN_MARK + secrets.token_urlsafe(32)
    api_token = ApiToken.objects.create(
        user=user,
        label=label,
        token_prefix=token[:API_TOKEN_PREFIX_LENGTH],
        token_hash=hash_token(token),
        created_at=now,
        expires_at=None
        if expires_in_days is None
        else now + timedelta(days=expires_in_days),
    )
    return api_token, token


def revoke(tokens: QuerySet[ApiToken], *, now: datetime) -> int:
    """Revoke the tokens of ``tokens`` not yet revoked; how many were."""
    return tokens.filter(revoked_at__isnull=True).update(revoked_at=now)


def authenticate(token: str) -> ApiToken | None:
    """The token's row with its user (revoked or not), or None if unknown."""
    if not token.startswith(TOKEN_MARK) or not (
        API_TOKEN_PREFIX_LENGTH < len(token) <= MAX_TOKEN_LENGTH
    ):
        return None
    digest = hash_token(token)
    candidates = ApiToken.objects.filter(
        token_prefix=token[:API_TOKEN_PREFIX_LENGTH]
    ).select_related("user")
    for candidate in candidates:
        if hmac.compare_digest(candidate.token_hash, digest):
            return candidate
    return None


def touch(api_token: ApiToken, *, now: datetime) -> None:
    """Record that the token was used (at most once per its resolution)."""
    if api_token.used_long_ago(now):
        ApiToken.objects.filter(pk=api_token.pk).update(last_used=now)
        api_token.last_used = now
