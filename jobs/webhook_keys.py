"""Webhook secrets: how they are made, kept and turned into signing keys.

A secret is ``whsec_`` and the base64 of 32 random bytes (the Standard Webhooks
format; the receiver verifies with it). Recall must sign with it on every
delivery, so it cannot keep only a hash: it keeps the secret encrypted
(Fernet: AES-128-CBC with HMAC-SHA256) under a key derived from ``SECRET_KEY``
with HKDF. A database dump alone reveals no secret. Keys in
``SECRET_KEY_FALLBACKS`` (the environment's comma-separated list) still
decrypt, so ``SECRET_KEY`` can be rotated the way Django rotates it; new
encryptions always use the current key. Secrets encrypted under an old key are
re-encrypted under the current one by ``manage.py reencrypt_webhook_secrets``
(``reencrypt``), or when the endpoint's secret is rotated; after that the old
key can leave the fallbacks.
"""

from __future__ import annotations

import base64
import binascii
import secrets

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

PREFIX = "whsec_"
SECRET_BYTES = 32  # the specification asks for at least 24
_HKDF_INFO = b"recall webhook endpoint secrets v1"


class SecretUnreadable(ValueError):
    """A stored secret that no current or fallback SECRET_KEY decrypts."""


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def signing_key(secret: str) -> bytes:
    """The HMAC key a ``whsec_`` secret stands for (its base64-decoded bytes)."""
    try:
        return base64.b64decode(secret.removeprefix(PREFIX), validate=True)
    except binascii.Error as error:
        raise ValueError("not a whsec_ secret") from error


def _fernet(secret_key: str) -> Fernet:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO).derive(
        secret_key.encode()
    )
    return Fernet(base64.urlsafe_b64encode(key))


def _keys() -> MultiFernet:
    fallbacks = getattr(settings, "SECRET_KEY_FALLBACKS", [])
    return MultiFernet([_fernet(k) for k in [settings.SECRET_KEY, *fallbacks]])


def encrypt(secret: str) -> str:
    """Encrypted under the current ``SECRET_KEY`` (never a fallback)."""
    return _keys().encrypt(secret.encode()).decode()


def is_current(stored: str) -> bool:
    """Whether the current ``SECRET_KEY`` alone decrypts ``stored``."""
    try:
        _fernet(settings.SECRET_KEY).decrypt(stored.encode())
    except InvalidToken:
        return False
    return True


def reencrypt(stored: str) -> str:
    """``stored`` decrypted with whichever key can (the current one or a
    fallback) and encrypted again under the current key; SecretUnreadable if
    none can."""
    try:
        return _keys().rotate(stored.encode()).decode()
    except InvalidToken as error:
        raise SecretUnreadable(
            "The webhook secret cannot be decrypted with SECRET_KEY or "
            "SECRET_KEY_FALLBACKS. Rotate the endpoint's secret."
        ) from error


def decrypt(stored: str) -> str:
    try:
        return _keys().decrypt(stored.encode()).decode()
    except InvalidToken as error:
        raise SecretUnreadable(
            "The webhook secret cannot be decrypted with SECRET_KEY or "
            "SECRET_KEY_FALLBACKS: was SECRET_KEY changed without keeping the "
            "old one as a fallback? Rotate the endpoint's secret."
        ) from error
