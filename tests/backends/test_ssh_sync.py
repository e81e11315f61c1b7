"""The SSH backend drives the sync engine: push before commands, pull back at close."""

from __future__ import annotations

import os

import pytest

from tests.backends.test_ssh import _make

pytestmark = pytest.mark.ssh


def test_push_before_command_and_pull_back_at_close(sshd_server, tmp_path):
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "src" / "app.py").write_text("print('v1')\n")
    (work / ".git").mkdir()
    (work / ".git" / "HEAD").write_text("ref\n")
    remote = f"hermes_sync_{os.getpid()}_{tmp_path.name}"
    seen = []
    env = _make(sshd_server, tmp_path, sync=[{"host": str(work), "remote": remote}], sync_interval_s=0)
    env.sync_progress = seen.append
    try:
        r = env.execute(f"cat ~/{remote}/src/app.py; test -e ~/{remote}/.git && echo git-synced || echo no-git")
        assert r.output == "print('v1')\nno-git\n"
        assert seen and seen[-1].phase == "push"
        # a host change reaches the next command
        (work / "src" / "app.py").write_text("print('v2')\n")
        assert env.execute(f"cat ~/{remote}/src/app.py").output == "print('v2')\n"
        # the agent's changes in the target
        env.execute(f"echo new > ~/{remote}/src/made.txt; echo edited > ~/{remote}/src/app.py")
    finally:
        env.close()
    assert (work / "src" / "made.txt").read_text() == "new\n"
    assert (work / "src" / "app.py").read_text() == "edited\n"
    assert env.last_pull is not None


def test_sync_options_validated(sshd_server, tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="remote"):
        _make(sshd_server, tmp_path, sync=[{"host": str(tmp_path)}])
    with pytest.raises(ValidationError, match="hots"):
        _make(sshd_server, tmp_path, sync=[{"hots": str(tmp_path), "remote": "x"}])


def test_no_sync_configured_means_no_engine(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path) as env:
        assert env.sync_engine is None
        assert env.execute("echo ok").output == "ok\n"
