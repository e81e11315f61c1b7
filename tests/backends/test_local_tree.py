"""The local backend's process tree never signals a process group by an id that was given out again."""

from __future__ import annotations

import signal
import subprocess

import pytest

from hermes_env_core.backends._local_tree import ProcessTree


def _group_leader() -> subprocess.Popen[bytes]:
    # Leads a group of its own, as a process that was given a reaped command's id would.
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def test_a_reaped_roots_id_that_names_another_process_is_left_alone():
    other = _group_leader()
    try:
        tree = ProcessTree(other.pid, reaped=True)  # the root was waited for; its id is someone else's now
        tree.stop(signal.SIGKILL)
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=0.5)
        assert tree.alive() == []
    finally:
        other.kill()
        other.wait()


def test_a_live_roots_group_is_signalled():
    root = _group_leader()
    try:
        ProcessTree(root.pid).stop(signal.SIGKILL)
        assert root.wait(timeout=10) == -signal.SIGKILL
    finally:
        root.kill()
        root.wait()
