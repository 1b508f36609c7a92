"""Token policy: how worker tokens and lease tokens are made and stored.

Worker tokens are bearer credentials: only their SHA-256 is stored, with the
first characters in clear so a token can be found without scanning every
worker. Lease tokens fence a lease: a worker whose lease ended holds a token
that no longer matches the job.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Protocol

TOKEN_PREFIX_LENGTH = 8
MAX_TOKEN_LENGTH = 256


def new_worker_token() -> str:
    """A new worker token: 32 random bytes, URL-safe, never starting with "-".

    One token in 64 would otherwise begin with a dash, and a command line
    that gives it as the value of an option (``recall_worker.py --token
    TOKEN``) would then read it as an option of its own and refuse to start.
    Drawing again costs one character of the first 64 nothing worth
    counting (log2 64/63 bits)."""
    while True:
        token = secrets.token_urlsafe(32)
        if not token.startswith("-"):
            return token


def new_lease_token() -> str:
    return secrets.token_urlsafe(24)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def token_prefix(token: str) -> str:
    return token[:TOKEN_PREFIX_LENGTH]


def plausible_worker_token(token: str) -> bool:
    """Long enough to have a prefix, short enough to be worth hashing."""
    return TOKEN_PREFIX_LENGTH < len(token) <= MAX_TOKEN_LENGTH


class HoldsToken(Protocol):
    token_prefix: str
    token_hash: str


def issue_worker_token(worker: HoldsToken) -> str:
    """Give ``worker`` (unsaved) a new token's prefix and hash; return the
    token, the only time it exists in clear."""
    token = new_worker_token()
    worker.token_prefix, worker.token_hash = token_prefix(token), hash_token(token)
    return token
