"""Faults of the session server: each gives the running command an infrastructure
error or a 124/137 result within its timeout plus 5 s, and the next command runs
on a new server with the checkpointed state and a note saying so."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence

import psutil
import pytest

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.environment.channel import ChannelStream
from hermes_env_core.environment.server import BOOT_ARGV as SERVER_ARGV
from hermes_env_core.errors import BackendError


def _server_pid(env: LocalEnvironment) -> int:
    """The session server's pid: the parent of a command's shell-level process."""
    return int(env.execute("echo $$").output)


def _new_server_noted(notes: Sequence[str]) -> bool:
    return any("new session server" in n for n in notes)


def _run_in_thread(env: LocalEnvironment, command: str, **kw: object) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = env.execute(command, **kw)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            out["error"] = exc
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wait_for_child(pid: int, name: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(c.name() == name for c in psutil.Process(pid).children(recursive=True)):
            return
        time.sleep(0.02)
    raise AssertionError(f"no {name} under {pid}")


def test_server_killed_mid_command() -> None:
    with LocalEnvironment() as env:
        env.execute("export HERMES_T_F=kept; cd /tmp")
        pid = _server_pid(env)
        t, out = _run_in_thread(env, "sleep 60", timeout=10)
        _wait_for_child(pid, "sleep")
        os.kill(pid, signal.SIGKILL)
        t.join(15)
        assert not t.is_alive()
        assert out["took"] < 10 + 5  # type: ignore[operator]
        # The local target can tell what ended the shell: a result, not a guess.
        r = out.get("result")
        assert r is not None and r.exit_code == 137, out  # type: ignore[union-attr]
        assert any("signal 9" in n for n in r.notes)  # type: ignore[union-attr]
        again = env.execute('echo "$HERMES_T_F"; pwd')
        assert again.output == "kept\n/tmp\n"
        assert _new_server_noted(again.notes), again.notes
        assert _server_pid(env) != pid


class _CuttableStream:
    """A stream that can be cut: closed under the reader, or after part of a write came back."""

    def __init__(self, inner: ChannelStream) -> None:
        self.inner = inner
        self.cut_after_mark = False
        self.cut_now = threading.Event()

    def read(self, n: int) -> bytes:
        if self.cut_now.is_set():
            return b""
        data = self.inner.read(n)
        if self.cut_after_mark and b"\x1e" in data and b":X" in data:
            # Half of the report frame, then the stream breaks.
            self.cut_now.set()
            return data[: data.index(b":X") + 3]
        return data

    def write(self, data: bytes) -> None:
        if self.cut_now.is_set():
            raise BrokenPipeError("cut")
        self.inner.write(data)

    def close(self) -> None:
        self.cut_now.set()
        self.inner.close()


class _FaultyLocal(LocalEnvironment):
    streams: list[_CuttableStream]

    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        stream = super()._open_channel(argv)
        if tuple(argv) != SERVER_ARGV:
            return stream
        wrapped = _CuttableStream(stream)
        self.__dict__.setdefault("streams", []).append(wrapped)
        return wrapped


def test_a_new_server_keeps_the_status_oldpwd_and_directory_stack(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with LocalEnvironment(cwd=str(tmp_path)) as env:
        pid = _server_pid(env)
        assert env.execute(f"cd a; cd ../b; pushd {tmp_path}/a >/dev/null; V=1; (exit 7)").exit_code == 7
        os.kill(pid, signal.SIGKILL)
        r = env.execute('echo "$?|$OLDPWD|${DIRSTACK[*]}|$PWD|$V"')
        assert _new_server_noted(r.notes)
        assert _server_pid(env) != pid
        assert r.output == f"7|{tmp_path}/b|{tmp_path}/a {tmp_path}/b|{tmp_path}/a|1\n"
        # under errexit, a failed last command's status is kept and does not end the new server
        env.execute("set -e")
        pid = _server_pid(env)
        assert env.execute("! true").exit_code == 1  # a status errexit does not act on
        os.kill(pid, signal.SIGKILL)
        r = env.execute('echo "$?"; [[ -o errexit ]] && echo errexit')
        assert r.output == "1\nerrexit\n" and _new_server_noted(r.notes)


def test_stream_closed_mid_command() -> None:
    with _FaultyLocal() as env:
        env.execute("export HERMES_T_F=kept")
        pid = _server_pid(env)
        t, out = _run_in_thread(env, "sleep 60", timeout=10)
        _wait_for_child(pid, "sleep")
        env.streams[-1].close()  # the transport goes away under the running command
        t.join(15)
        assert not t.is_alive() and out["took"] < 15  # type: ignore[operator]
        # An infrastructure error, or (closing a local stream kills its shell) the shell's own 137.
        r = out.get("result")
        assert isinstance(out.get("error"), BackendError) or (r is not None and r.exit_code == 137), out  # type: ignore[union-attr]
        again = env.execute('echo "$HERMES_T_F"')
        assert again.output == "kept\n" and _new_server_noted(again.notes)
        assert not (psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)


def test_half_written_report() -> None:
    with _FaultyLocal() as env:
        env.execute("export HERMES_T_F=kept")
        env.streams[-1].cut_after_mark = True
        t0 = time.monotonic()
        with pytest.raises(BackendError, match="lost"):
            env.execute("echo partial", timeout=5)
        assert time.monotonic() - t0 < 5 + 5
        again = env.execute('echo "$HERMES_T_F"')
        assert again.output == "kept\n" and _new_server_noted(again.notes)


def test_stdin_never_reads_the_protocol() -> None:
    with LocalEnvironment() as env:
        t0 = time.monotonic()
        r = env.execute("cat; read -r x; echo \"rc=$? x=$x\"", timeout=10)
        assert r.output == "rc=1 x=\n" and time.monotonic() - t0 < 5
        assert env.execute("echo alive").output == "alive\n"
