"""Predictable paths in the temporary directory (issue 24, item 13).

Before, the server kept its metrics directory (``recall-metrics-<master
pid>``), the long-poll probe's answer and its nudge sockets straight in the
temporary directory, at names any local user could create first, and used
whatever it found there. Now they live in one directory only Recall's user can
enter (``RECALL_RUN_DIR``, by default ``recall-<uid>`` in the temporary
directory), created with mode 0700, and the server refuses to start if that
directory, or a ``PROMETHEUS_MULTIPROC_DIR`` it is given, is not its own.
"""

from __future__ import annotations

import os
import re
import stat
import time

import pytest

from harness.server import Server, free_port
from recall_site import rundir
from tests.support.factories import make_worker
from tests.support.raw_clients import claim_bytes, connect, serving
from tests.support.server import served_database_url

as_root = pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _shared_tmp(tmp_path):
    """A temporary directory like /tmp: anyone may create names in it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    return tmp


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_server_keeps_its_files_in_a_directory_of_its_own(tmp_path):
    tmp = _shared_tmp(tmp_path)
    with serving(tmp_path, 2, 2, env={"TMPDIR": str(tmp)}) as (port, log):
        master = int(re.search(r"Listening at: \S+ \((\d+)\)", log.read_text())[1])
        worker = make_worker("waiting")
        sock = connect(port)
        sock.sendall(claim_bytes(worker.token, 10))
        private = tmp / f"recall-{os.getuid()}"
        probe = private / f"long-poll-{master}"
        deadline = time.monotonic() + 10
        # The first probe writes its answer; each process makes its socket.
        while not probe.exists() or len(list(private.glob("*.sock"))) < 2:
            assert time.monotonic() < deadline, sorted(os.listdir(tmp))
            time.sleep(0.05)
        in_tmp = sorted(os.listdir(tmp))
        inside = sorted(os.listdir(private))
        modes = {name: _mode(private / name) for name in inside}
        sock.close()

    assert in_tmp == [private.name]
    assert (_mode(private), os.lstat(private).st_uid) == (0o700, os.getuid())
    sockets = [name for name in inside if name.endswith(".sock")]
    assert inside == sorted([f"long-poll-{master}", f"metrics-{master}", *sockets])
    assert len(sockets) == 2
    assert modes[f"metrics-{master}"] == 0o700
    # Gone with the server.
    assert os.listdir(private) == []


def _refused(tmp_path, env: dict) -> str:
    """Start the server with ``env``; it must exit at once, refusing to start:
    what it said."""
    port = free_port()
    full_env = {
        "PATH": os.environ["PATH"],
        "SECRET_KEY": os.environ["SECRET_KEY"],
        "DATABASE_URL": served_database_url(),
        "RECALL_HTTPS": "off",
        "RECALL_STARTUP_SWEEP": "off",
        "WEB_CONCURRENCY": "1",
        "RECALL_WEB_THREADS": "2",
        **env,
    }
    server = Server(full_env, tmp_path / "refused.log", port=port)
    assert server.wait(timeout=30) != 0
    said = server.text()
    assert "Booting worker" not in said
    return said


def _planted_world_writable(tmp, tmp_path):
    planted = tmp / f"recall-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    return {"TMPDIR": str(tmp)}, f"{planted} has mode 0777: others may write in it"


def _planted_symlink(tmp, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    planted = tmp / f"recall-{os.getuid()}"
    planted.symlink_to(target)
    return {"TMPDIR": str(tmp)}, f"{planted} is a symbolic link"


def _planted_by_another_user(tmp, tmp_path):
    planted = tmp / f"recall-{os.getuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)
    return {"TMPDIR": str(tmp)}, f"{planted} belongs to uid 65534, not to Recall's"


def _open_metrics_dir(tmp, tmp_path):
    metrics = tmp / "metrics"
    metrics.mkdir()
    metrics.chmod(0o777)
    env = {"TMPDIR": str(tmp), "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
    return env, f"{metrics} has mode 0777: others may write in it"


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize(
    "plant",
    [
        _planted_world_writable,
        _planted_symlink,
        pytest.param(_planted_by_another_user, marks=as_root),
        _open_metrics_dir,
    ],
    ids=["world-writable", "symlink", "another-user", "metrics-dir"],
)
def test_the_server_refuses_a_directory_that_is_not_its_own(tmp_path, plant):
    tmp = _shared_tmp(tmp_path)
    env, reason = plant(tmp, tmp_path)

    said = _refused(tmp_path, env)

    assert f"Recall will not start: {reason}" in said
    planted = tmp / f"recall-{os.getuid()}"
    if planted.is_dir():
        assert os.listdir(planted) == []  # nothing written in it


def test_a_run_directory_is_made_private_and_checked(tmp_path):
    made = rundir.ensure(str(tmp_path / "run"))

    assert _mode(made) == 0o700
    assert rundir.ensure(made) == made  # its own: accepted again
    os.chmod(made, 0o750)
    with pytest.raises(rundir.UnsafeDirectory, match="mode 0750: others may look"):
        rundir.ensure(made)
    assert rundir.ensure(made, others_may_read=True) == made
    os.chmod(made, 0o770)
    with pytest.raises(rundir.UnsafeDirectory, match="mode 0770: others may write"):
        rundir.ensure(made, others_may_read=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(rundir.UnsafeDirectory, match="is not a directory"):
        rundir.ensure(str(tmp_path / "file"))


def test_the_run_directory_defaults_to_one_per_user_in_the_temporary_directory(
    monkeypatch, tmp_path
):
    monkeypatch.delenv(rundir.ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)

    assert rundir.path() == os.path.join(str(tmp_path), f"recall-{os.getuid()}")
    monkeypatch.setenv(rundir.ENV, str(tmp_path / "mine"))
    assert rundir.path() == str(tmp_path / "mine")


@as_root
def test_a_run_directory_made_by_root_for_another_user_is_theirs(tmp_path):
    made = rundir.ensure(str(tmp_path / "run"), owner=(65534, 65534))

    assert (os.lstat(made).st_uid, _mode(made)) == (65534, 0o700)
    with pytest.raises(rundir.UnsafeDirectory, match="belongs to uid 65534"):
        rundir.ensure(made)  # not root's own
