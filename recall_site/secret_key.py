"""The secret key: the embedded set-up's key file, and what counts as too weak.

Standard library only (settings import it before Django is configured), and
runnable: ``python -m recall_site.secret_key PATH`` prints the key in PATH,
creating it first if needed (``make run`` and ``make demo`` use it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path

# Django's own definition of a weak key (django.core.checks.security.base).
MIN_LENGTH = 50
MIN_UNIQUE_CHARACTERS = 5
INSECURE_PREFIX = "django-insecure-"


def key_file(path: Path) -> str:
    """The key stored in ``path``; a new random one (mode 600) if there is none.

    Safe when several processes start at once (gunicorn, the cluster, a
    command): the file appears whole or not at all, and only one key wins.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, (secrets.token_urlsafe(MIN_LENGTH) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(draft, path)  # fails if another process got there first
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                draft.unlink()
    return path.read_text().strip()


def weakness(key: str) -> str | None:
    """Why ``key`` is too weak for a server that is not in DEBUG, or None."""
    if key.startswith(INSECURE_PREFIX):
        return f"it starts with Django's {INSECURE_PREFIX!r} prefix"
    if len(key) < MIN_LENGTH:
        return f"it has {len(key)} characters; at least {MIN_LENGTH} are needed"
    if len(set(key)) < MIN_UNIQUE_CHARACTERS:
        return f"it has fewer than {MIN_UNIQUE_CHARACTERS} different characters"
    return None


if __name__ == "__main__":
    print(key_file(Path(sys.argv[1])))
