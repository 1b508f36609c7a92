"""Standard Webhooks signatures (https://www.standardwebhooks.com/).

The signed content is ``{webhook-id}.{webhook-timestamp}.{body}``; the signature
is ``v1,`` and the base64 of its HMAC-SHA256 under the secret's key. While a
secret is being rotated, each valid secret signs, separated by spaces.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Sequence

from jobs.webhook_keys import signing_key


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    content = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(signing_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_header(
    secrets: Sequence[str], webhook_id: str, timestamp: int, body: bytes
) -> str:
    """The ``webhook-signature`` header: one signature per valid secret."""
    return " ".join(sign(s, webhook_id, timestamp, body) for s in secrets)
