"""The base class's other paths, run through the whole conformance suite.

``HeredocLocal`` takes stdin the way backends without a stdin stream do;
``ThreadedLocal`` runs bash behind ``ThreadedProcessHandle`` the way SDK
backends do, so both paths are held to the same contract as local.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess

import pytest

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.environment.handles import ThreadedProcessHandle
from hermes_env_core.errors import BackendError
from hermes_env_core.testing import EnvironmentConformance


class HeredocLocal(LocalEnvironment):
    """Like a backend whose SDK cannot stream stdin: the private script goes through a 0600 file."""

    _open_channel = BaseEnvironment._open_channel  # this variant tests the process path
    name = "local-heredoc"
    stdin_mode = "heredoc"

    def _put_private_file(self, path, data):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


class ThreadedLocal(LocalEnvironment):
    """Like an SDK backend: a blocking call in a thread, output pushed in chunks."""
    _open_channel = BaseEnvironment._open_channel  # this variant tests the process path

    name = "local-threaded"
    records_pid = True

    def _run_bash(self, script, *, login, timeout, stdin_data):
        proc = super()._run_bash(script, login=login, timeout=timeout, stdin_data=stdin_data)

        def target(write):
            # Finish when bash exits, not at EOF: a background child may hold
            # the stream open, as it holds an exec's attach stream.
            assert proc.stdout is not None
            fd = proc.stdout.fileno()
            while True:
                ready, _, _ = select.select([fd], [], [], 0.02)
                if ready:
                    chunk = os.read(fd, 32768)
                    if not chunk:
                        break
                    write(chunk)
                elif proc.poll() is not None:
                    break
            return proc.wait()

        handle = ThreadedProcessHandle(
            target,
            on_kill=lambda: proc.kill(),
            on_terminate=lambda: proc.terminate(),
        )
        handle.proc = proc  # type: ignore[attr-defined]
        return handle

    def _kill_tree(self, handle, wrapped, *, graceful):
        # As a remote backend does: read the pid the wrapper recorded, then
        # signal the tree from a separate command.
        if self._tree(handle, wrapped, "TERM" if graceful else "KILL") is None:
            handle.kill()

    def _tree_alive(self, handle, wrapped):
        found = self._tree(handle, wrapped, "0")
        return None if found is None else bool(found)

    def _tree(self, handle, wrapped, sig):
        from hermes_env_core.backends._tree_script import TREE_DONE, parse_tree_output, tree_script

        try:
            with open(wrapped.pidfile) as f:
                pid = wrapped.pid_from(f.read())
        except OSError:
            pid = None
        if pid is None:
            return None
        seen = handle.__dict__.setdefault("seen", set())
        out = subprocess.run(["bash", "-c", tree_script(sig, pid, known=seen)], capture_output=True, check=False).stdout
        if TREE_DONE.encode() not in out:
            return None
        found = parse_tree_output(out)
        seen |= found
        return found


class TestHeredocConformance(EnvironmentConformance):
    @pytest.fixture
    def environment(self):
        with HeredocLocal(timeout=60) as env:
            yield env


class TestThreadedConformance(EnvironmentConformance):
    # Background children hold the pipe the thread reads, as an exec stream
    # that outlives its process does; the handle must still report promptly.
    @pytest.fixture
    def environment(self):
        with ThreadedLocal(timeout=60) as env:
            yield env


class Exploding(LocalEnvironment):
    """An SDK whose call fails after some output."""
    _open_channel = BaseEnvironment._open_channel  # this variant tests the process path

    name = "exploding"
    fail_on = "boom"

    def _run_bash(self, script, *, login, timeout, stdin_data):
        if self.fail_on.encode() not in (stdin_data or b""):  # the command travels privately
            return super()._run_bash(script, login=login, timeout=timeout, stdin_data=stdin_data)

        def target(write):
            write(b"partial output\n")
            raise ConnectionResetError("sandbox went away")

        return ThreadedProcessHandle(target)


def test_sdk_exception_is_an_infrastructure_error_not_exit_1():
    with Exploding() as env:
        assert env.execute("echo fine").output == "fine\n"
        with pytest.raises(BackendError, match="sandbox went away"):
            env.execute("echo boom")
        assert env.execute("echo still fine").output == "still fine\n"


def test_threaded_handle_streams_as_it_arrives():
    import threading

    gate = threading.Event()
    seen = []

    def target(write):
        write(b"first\n")
        if not gate.wait(10):
            raise AssertionError("reader never saw the first chunk")
        write(b"second\n")
        return 0

    h = ThreadedProcessHandle(target)
    assert h.stdout is not None
    seen.append(os.read(h.stdout.fileno(), 100))
    gate.set()
    seen.append(os.read(h.stdout.fileno(), 100))
    assert h.wait(5) == 0
    assert seen == [b"first\n", b"second\n"]


def test_threaded_handle_reader_gone_does_not_hang_writer():
    h = ThreadedProcessHandle(lambda write: [write(b"x" * 65536) for _ in range(50)] and 0)
    assert h.stdout is not None
    h.stdout.close()
    assert h.wait(10) == 0


def test_popen_satisfies_the_protocol():
    from hermes_env_core.environment.handles import ProcessHandle

    p = subprocess.Popen(["true"], stdout=subprocess.PIPE)
    try:
        assert isinstance(p, ProcessHandle)
    finally:
        p.wait()
        p.stdout.close()


def test_signal_sent_by_timeout_reaches_trapping_tree(tmp_path):
    # SIGTERM first: a command that cleans up on TERM gets to do it.
    log = tmp_path / "log"
    with LocalEnvironment(kill_grace_s=5) as env:
        # The command's own processes get SIGTERM (the session's shell is frozen, then ended).
        r = env.execute(f"bash -c \"trap 'echo cleaned >{log}; exit 0' TERM; sleep 60 & wait\"", timeout=0.5)
    assert r.timed_out
    assert log.read_text() == "cleaned\n"
    assert signal.SIGTERM  # the graceful signal is the one the trap saw


def test_signal_death_reports_128_plus_n():
    with LocalEnvironment() as env:
        assert env.execute("kill -TERM $$").exit_code == 143
        assert env.execute("kill -KILL $$").exit_code == 137
        assert env.execute("echo alive").output == "alive\n"


def test_tilde_cwd_expands_to_target_home(tmp_path):
    home = tmp_path / "h"
    (home / "sub").mkdir(parents=True)
    with LocalEnvironment(env={"HOME": str(home)}, cwd="~") as env:
        assert env.execute("pwd").output == f"{home}\n"
        assert env.execute("pwd", cwd="~/sub").output == f"{home}/sub\n"


def test_pidfile_of_an_earlier_command_is_not_trusted():
    with ThreadedLocal() as env:
        env.execute("true")
        w = env.session.wrap("true", record_pid=True)
        env.session.release(w)
        assert w.pid_from(f"123 {w.pid_token}") == 123
        assert w.pid_from("123 someothernonce") is None
        # The pidfile's token is not the frame's nonce: a child reading it cannot forge a frame.
        assert w.pid_token != w.nonce and w.nonce not in w.pid_token
        assert w.pid_from("123") is None


class NotingLocal(LocalEnvironment):
    _open_channel = BaseEnvironment._open_channel  # this variant tests the process path
    def _run_bash(self, script, *, login, timeout, stdin_data):
        proc = super()._run_bash(script, login=login, timeout=timeout, stdin_data=stdin_data)
        if b"; echo mark-me" in (stdin_data or b""):
            proc.notes = ("this command only",)  # type: ignore[attr-defined]
        return proc


def test_handle_notes_reach_only_their_own_result():
    with NotingLocal() as env:
        assert env.execute("echo mark-me").notes == ("this command only",)
        assert env.execute("echo other").notes == ()
