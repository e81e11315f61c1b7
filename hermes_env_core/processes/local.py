"""Background processes on this machine: real children on a pipe or a PTY.

Each runs in its own session (process group). One thread per process waits
in ``poll()`` on the output and on a pidfd, so an exit is seen the moment it
happens, not at the next tick of a timer.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import shlex
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

from . import inputwait, procinfo
from .process import ProcessError

if TYPE_CHECKING:
    from .process import BackgroundProcess

__all__ = ["AdoptedLocalDriver", "LocalPipeDriver", "LocalPtyDriver"]

_READ = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _pty_bash_args(bash: str, script: str, login: bool) -> list[str]:
    """argv for a pty child (ptyprocess passes no descriptors): the script goes
    through a 0600 file that bash reads and removes before running it."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="hermes-bg-", suffix=".sh")
    with os.fdopen(fd, "wb") as f:
        f.write(script.encode("utf-8", "surrogateescape"))
    q = shlex.quote(path)
    args = [bash, "-l"] if login else [bash]
    return args + ["-c", f'__hermes_c=$(<{q}); command rm -f -- {q}; builtin eval "$__hermes_c"', "bash"]


def _bash_args(bash: str, script: str, login: bool) -> tuple[list[str], int]:
    """argv for running ``script``; a too-long script goes through a pipe (returned fd, else -1)."""
    # Always through a pipe: the script carries the session's state, which
    # must never be on a command line (bash sources all of it before running).
    args = [bash, "-l"] if login else [bash]
    r, w = os.pipe()
    data = script.encode("utf-8", "surrogateescape")

    def feed() -> None:
        try:
            with os.fdopen(w, "wb") as f:
                f.write(data)
        except OSError:
            pass

    threading.Thread(target=feed, name="hermes-env-bg-script", daemon=True).start()
    return args + ["-c", f"builtin source /dev/fd/{r}", "bash"], r


class _Quiet:
    """When a silent PTY child is next checked for a terminal read: once per wait."""

    _RECHECK_S = 0.5  # silent but busy: look again this often

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s
        self._at: float | None = None
        self.reset()

    def reset(self) -> None:
        """Output arrived or input was written: a new silence starts."""
        self._at = None if self.after_s is None else time.monotonic() + self.after_s

    def recheck(self) -> None:
        self._at = time.monotonic() + self._RECHECK_S

    def reported(self) -> None:
        self._at = None  # until the next output or input

    def due(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at

    def cap(self, wait_ms: int | None) -> int | None:
        if self._at is None:
            return wait_ms
        left = max(0, int((self._at - time.monotonic()) * 1000) + 1)
        return left if wait_ms is None else min(wait_ms, left)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class _Follower:
    """Reads ``fd`` into the process and reports the exit of ``pid`` (our child)."""

    kind = "local"

    def __init__(self, pid: int, fd: int) -> None:
        self.pid: int | None = pid
        self.pgid = pid  # start_new_session / setsid: the leader's pid
        self.start_time = procinfo.start_time(pid)
        self._fd = fd
        self._pidfd = procinfo.open_pidfd(pid)
        self._gone = threading.Event()
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._proc: BackgroundProcess | None = None
        self._wlock = threading.Lock()
        self._early: int | None = None
        #: seconds of silence after which a PTY child is checked for a terminal read
        self.input_wait_s: float | None = None
        self._rearm = threading.Event()  # input was written: a new wait may be reported
        self._last_output = time.monotonic()

    def start(self, proc: BackgroundProcess) -> None:
        self._proc = proc
        self._thread = threading.Thread(target=self._run, name=f"hermes-env-bg-{proc.id}", daemon=True)
        self._thread.start()

    def _read(self) -> bytes | None:
        """One read; None at end of output (EOF, or EIO: a PTY whose other side closed)."""
        try:
            data = os.read(self._fd, _READ)
        except BlockingIOError:
            return b""
        except OSError as exc:
            if exc.errno == errno.EINTR:
                return b""
            return None
        return data or None

    def _run(self) -> None:
        proc = self._proc
        assert proc is not None
        poller = select.poll()
        poller.register(self._fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        poller.register(self._stop_r, select.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, select.POLLIN)
        out_open = True
        exited = reported = False
        os.set_blocking(self._fd, False)
        quiet = _Quiet(self.input_wait_s)
        try:
            while True:
                wait_ms = None if self._pidfd is not None or exited else 20
                if not exited:
                    wait_ms = quiet.cap(wait_ms)
                events = poller.poll(wait_ms)
                if self._rearm.is_set():
                    self._rearm.clear()
                    quiet.reset()
                for fd, _ in events:
                    if fd == self._stop_r:
                        return
                    if fd == self._fd:
                        data = self._read()
                        if data is None:
                            out_open = False
                            poller.unregister(self._fd)
                        elif data:
                            quiet.reset()
                            self._last_output = time.monotonic()
                            proc._feed(data)
                    elif fd == self._pidfd:
                        poller.unregister(self._pidfd)
                        exited = True
                if not exited and quiet.due():
                    if self._waiting_for_input():
                        quiet.reported()
                        proc._waiting_for_input()
                    else:
                        quiet.recheck()
                if not exited and self._pidfd is None:
                    exited = self._poll_exit()
                if exited and not reported:
                    # Whatever it wrote before exiting is in the pipe now: take it all.
                    while out_open:
                        data = self._read()
                        if data is None:
                            out_open = False
                        elif data:
                            proc._feed(data)
                        else:
                            break
                    status = self._reap()
                    reported = True
                    self._gone.set()
                    proc._finish(_exit_code(status) if status is not None else None, output_done=not out_open)
                    if not out_open:
                        return
                    # A child of it may still write: keep its output until EOF.
                elif not out_open and exited:
                    return
        finally:
            if reported:
                proc._output_ended()
            self._close()

    def _poll_exit(self) -> bool:
        """Without pidfds: has the child exited? (reaps it; ``_reap`` returns the status)."""
        try:
            pid, status = os.waitpid(self.pid or -1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid:
            self._early = status
        return bool(pid)

    def _reap(self) -> int | None:
        if self._early is not None:
            return self._early
        try:
            _, status = os.waitpid(self.pid or -1, 0)
        except ChildProcessError:
            return None
        return status

    def _close(self) -> None:
        for fd in (self._fd, self._stop_r, self._stop_w, self._pidfd):
            if fd is not None and fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._stop_r = self._stop_w = -1
        self._pidfd = None

    def _waiting_for_input(self) -> bool:
        return False

    def waiting_now(self, quiet_s: float) -> bool:
        """Is it blocked reading its terminal right now, silent for ``quiet_s``? (PTY children)"""
        return time.monotonic() - self._last_output >= quiet_s and self._waiting_for_input()

    # -- control ---------------------------------------------------------------
    def _write_fd(self) -> int:
        raise NotImplementedError

    def write(self, data: bytes, timeout: float) -> None:
        self._rearm.set()
        fd = self._write_fd()
        view = memoryview(data)
        with self._wlock:
            while view:
                try:
                    n = os.write(fd, view)
                except BlockingIOError:
                    ready = select.select([], [fd], [], timeout)[1]
                    if not ready:
                        raise ProcessError(f"stdin of pid {self.pid}: not read for {timeout:g}s") from None
                    continue
                except (BrokenPipeError, OSError) as exc:
                    raise ProcessError(f"stdin of pid {self.pid} is closed: {exc}") from exc
                view = view[n:]

    def send_signal(self, sig: int) -> None:
        if self._gone.is_set() or self.pid is None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, OSError):
            pass

    def kill_tree(self, grace: float) -> None:
        assert self.pid is not None
        procinfo.kill_tree(self.pid, pgid=self.pgid, grace=grace, root_started=self.start_time, root_gone=self._gone)

    def set_window_size(self, rows: int, cols: int) -> None:
        raise ProcessError("not a terminal")

    def stop(self) -> None:
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass

    def record(self) -> dict[str, Any]:
        return {"driver": self.kind, "pid": self.pid, "start_time": self.start_time, "pgid": self.pgid}


class LocalPipeDriver(_Follower):
    """A child whose stdin is a pipe and whose stdout and stderr share another."""

    kind = "local"

    def __init__(self, *, bash: str, script: str, env: dict[str, str], login: bool = False) -> None:
        args, script_fd = _bash_args(bash, script, login)
        try:
            self._popen = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(script_fd,) if script_fd >= 0 else (),
                bufsize=0,
            )
        finally:
            if script_fd >= 0:
                os.close(script_fd)
        assert self._popen.stdout is not None and self._popen.stdin is not None
        out = self._popen.stdout.fileno()
        try:
            fcntl.fcntl(out, _F_SETPIPE_SZ, _READ)  # fewer, larger reads for chatty processes
        except OSError:
            pass
        os.set_blocking(self._popen.stdin.fileno(), False)
        super().__init__(self._popen.pid, os.dup(out))
        self._popen.stdout.close()

    def _reap(self) -> int | None:
        status = super()._reap()
        if status is not None:
            self._popen.returncode = _exit_code(status)  # so Popen never waits on a reused pid
        return status

    def _write_fd(self) -> int:
        stdin = self._popen.stdin
        if stdin is None or stdin.closed:
            raise ProcessError(f"stdin of pid {self.pid} is closed")
        return stdin.fileno()

    def close_stdin(self) -> None:
        with self._wlock:
            if self._popen.stdin is not None:
                try:
                    self._popen.stdin.close()
                except OSError:
                    pass


class LocalPtyDriver(_Follower):
    """A child on a pseudo-terminal (``ptyprocess``), for programs that want a TTY."""

    kind = "pty"

    def __init__(
        self, *, bash: str, script: str, env: dict[str, str], login: bool = False, size: tuple[int, int] = (24, 80)
    ) -> None:
        try:
            from ptyprocess import PtyProcess  # type: ignore[import-untyped]
        except ImportError as exc:  # pragma: no cover - a declared dependency
            raise ProcessError("pty=True needs the ptyprocess package: pip install ptyprocess") from exc
        self._pty = PtyProcess.spawn(_pty_bash_args(bash, script, login), env=env, dimensions=size)
        self._pty.delayafterclose = 0.0
        os.set_blocking(self._pty.fd, False)
        super().__init__(self._pty.pid, self._pty.fd)
        self._tty = inputwait.tty_of(self._pty.pid)

    def _waiting_for_input(self) -> bool:
        if self._tty is None or self.pid is None or self._gone.is_set():
            return False
        try:
            foreground = os.tcgetpgrp(self._fd)
        except OSError:
            return False
        return inputwait.waiting_in_group(self.pid, foreground, self._tty)

    def _reap(self) -> int | None:
        status = super()._reap()
        # Tell ptyprocess, so that its own close()/__del__ never waits or kills.
        self._pty.terminated = True
        self._pty.status = status
        return status

    def _close(self) -> None:
        try:
            self._pty.fileobj.close()  # owns the master fd
        except OSError:
            pass
        self._fd = -1
        super()._close()

    def _write_fd(self) -> int:
        return int(self._pty.fd)

    def close_stdin(self) -> None:
        # A terminal has no EOF of its own: Ctrl-D (VEOF) at the start of a line is one.
        self.write(b"\x04", 5.0)

    def set_window_size(self, rows: int, cols: int) -> None:
        self._pty.setwinsize(rows, cols)


class AdoptedLocalDriver:
    """A local process found alive in a checkpoint: watched and killable, its output gone with its old owner."""

    kind = "adopted"

    def __init__(self, pid: int, start_time: int, pgid: int | None, pidfd: int | None) -> None:
        self.pid: int | None = pid
        self.start_time = start_time
        self.pgid = pgid
        self._pidfd = pidfd
        self._gone = threading.Event()
        self._stop = threading.Event()

    def start(self, proc: BackgroundProcess) -> None:
        threading.Thread(target=self._run, args=(proc,), name=f"hermes-env-bg-{proc.id}", daemon=True).start()

    def _run(self, proc: BackgroundProcess) -> None:
        try:
            while not self._stop.is_set():
                if self._pidfd is not None:
                    if select.select([self._pidfd], [], [], 0.5)[0]:
                        break
                elif self._stop.wait(0.05) or not procinfo.is_alive(self.pid or 0, self.start_time):
                    break
            if not self._stop.is_set():
                self._gone.set()
                # Not our child: its exit code went to its parent.
                proc._finish(None, note="exit code unknown: the process was adopted from a checkpoint")
        finally:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None

    def write(self, data: bytes, timeout: float) -> None:
        raise ProcessError(f"pid {self.pid} was adopted from a checkpoint: its stdin is gone")

    def close_stdin(self) -> None:
        raise ProcessError(f"pid {self.pid} was adopted from a checkpoint: its stdin is gone")

    def send_signal(self, sig: int) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except OSError:
                pass
        elif self.pid is not None and procinfo.is_alive(self.pid, self.start_time):
            os.kill(self.pid, sig)

    def kill_tree(self, grace: float) -> None:
        assert self.pid is not None
        procinfo.kill_tree(self.pid, pgid=self.pgid, grace=grace, root_started=self.start_time, root_gone=self._gone)

    def set_window_size(self, rows: int, cols: int) -> None:
        raise ProcessError(f"pid {self.pid} was adopted from a checkpoint: its terminal is gone")

    def stop(self) -> None:
        self._stop.set()

    def record(self) -> dict[str, Any]:
        return {"driver": "local", "pid": self.pid, "start_time": self.start_time, "pgid": self.pgid}

