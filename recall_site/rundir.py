"""Recall's private run directory: the files one server shares between its
processes, where no other user can reach them.

The server keeps a few files at predictable names: the long-poll probe's
shared answer and each process's nudge socket (``recall_site/gunicorn_worker.py``),
the request metrics of its processes (``recall_site/metric_files.py``) and the
spooled bodies of requests being read. Kept straight in the system's temporary
directory, any local user could create those names first (a directory of their
own, a symbolic link to a file of Recall's user) and Recall would use them.
So they live in one directory that only Recall's user can enter:
``RECALL_RUN_DIR``, by default ``recall-<uid>`` in the temporary directory.
It is created with mode 0700; one that exists already must be a real directory
(not a symbolic link), owned by Recall's user, and closed to everyone else,
or the server refuses to start and says why.

Standard library only: gunicorn's master reads this before Django is set up.
"""

from __future__ import annotations

import os
import stat
import tempfile

ENV = "RECALL_RUN_DIR"


class UnsafeDirectory(Exception):
    """A directory Recall would keep its files in is not safe to use."""


def default() -> str:
    """``recall-<uid>`` in the system's temporary directory (``TMPDIR``)."""
    return os.path.join(tempfile.gettempdir(), f"recall-{os.getuid()}")


def path() -> str:
    """The run directory this process uses (not checked: see ``ensure``)."""
    return os.environ.get(ENV) or default()


def ensure(
    directory: str | None = None,
    *,
    others_may_read: bool = False,
    owner: tuple[int, int] | None = None,
) -> str:
    """Create ``directory`` (the run directory by default) with mode 0700 unless
    it exists, check it, and return its path.

    ``owner``: the (uid, gid) of the processes that will use it, when gunicorn's
    master (root) hands its workers to another user; a directory it creates is
    given to them. Refused with ``UnsafeDirectory``: a symbolic link, not a
    directory, owned by another user, or open to others: writable by its group
    or by anyone, and unless ``others_may_read``, readable or searchable too.
    """
    directory = os.path.abspath(directory or path())
    uid, gid = owner or (os.getuid(), os.getgid())
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass  # checked below, like one just made
    except OSError as error:
        raise UnsafeDirectory(f"cannot create {directory}: {error}") from None
    else:
        if uid != os.getuid():
            os.chown(directory, uid, gid)
    check(directory, others_may_read=others_may_read, uid=uid)
    return directory


def check(directory: str, *, others_may_read: bool = False, uid: int = -1) -> None:
    """Raise ``UnsafeDirectory`` unless ``directory`` is a directory of ``uid``
    (this process's user by default) that no one else may write in (nor read,
    unless ``others_may_read``)."""
    uid = os.getuid() if uid < 0 else uid
    try:
        info = os.lstat(directory)
    except OSError as error:
        raise UnsafeDirectory(f"cannot use {directory}: {error}") from None
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeDirectory(
            f"{directory} is a symbolic link; Recall keeps its files only in a "
            "directory of its own"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{directory} exists and is not a directory")
    if info.st_uid != uid:
        raise UnsafeDirectory(
            f"{directory} belongs to uid {info.st_uid}, not to Recall's user "
            f"(uid {uid}): another user may have created it first"
        )
    closed = 0o022 if others_may_read else 0o077
    mode = stat.S_IMODE(info.st_mode)
    if mode & closed:
        raise UnsafeDirectory(
            f"{directory} has mode {mode:04o}: others may "
            f"{'write in' if mode & 0o022 else 'look into'} it "
            f"(it must be {0o755 if others_may_read else 0o700:04o} at most; "
            f"chmod it or remove it)"
        )
