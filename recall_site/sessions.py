"""Django's database sessions, remembering when the loaded session expires.

Sliding expiry (``recall_site.middleware.SessionIdleMiddleware``) moves a
session's expiry on when its last save is more than a minute old; the stored
expiry says when that was (expiry = last save + ``SESSION_COOKIE_AGE``), so no
extra field, and no write on every request.
"""

from __future__ import annotations

from datetime import datetime

from django.contrib.sessions.backends import db


class SessionStore(db.SessionStore):
    """``expire_date``: the stored expiry of the session loaded, if any."""

    expire_date: datetime | None = None

    def _get_session_from_db(self):
        session = super()._get_session_from_db()
        self.expire_date = None if session is None else session.expire_date
        return session
