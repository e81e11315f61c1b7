"""Interactive programs on a terminal: ``hermes-env run --tty`` and the shell's terminal lines.

The command runs as a PTY background process of the session (its state, cwd and functions, on every
backend that runs ``pty=True`` processes); this side puts the caller's terminal in raw mode, copies
keys in and output out, and passes window-size changes on, as ``docker exec -it`` does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shlex
import signal
import sys
import termios
import threading
import time
import tty as _tty
from collections.abc import Iterator
from types import FrameType
from typing import Any

from ..environment.base import BaseEnvironment
from ..errors import HermesEnvError
from ..processes import BackgroundProcess, PollSettings, ProcessError, ProcessRegistry
from .ttylines import INTERACTIVE_PROGRAMS, TTY_MODES, SimpleCommand, needs_terminal, simple_commands, state_changes

__all__ = [
    "INTERACTIVE_PROGRAMS",
    "TTY_MODES",
    "SimpleCommand",
    "TerminalLostError",
    "cmd_run",
    "needs_terminal",
    "print_state_warning",
    "run_tty",
    "simple_commands",
    "state_changes",
    "window_size",
]


class TerminalLostError(HermesEnvError):
    """The program on the terminal was lost (its target went away) before it reported an exit status."""


# -- running a command on a terminal -----------------------------------------------------

#: How a process in a remote target is followed while a person types to it.
TTY_POLL = PollSettings(min_s=0.01, max_s=0.05, factor=1.5)
_BUFFER_BYTES = 8 * 1024 * 1024
_READ = 65536
_LOOK_S = 0.5  # how often the loop looks whether the program ended without its output's end
_STREAM_GRACE_S = 3.0
_EOF_QUIET_S = 1.0


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def window_size(*fds: int) -> tuple[int, int]:
    """(rows, cols) of the first of ``fds`` that is a terminal; (24, 80) when none is."""
    for fd in fds:
        try:
            size = os.get_terminal_size(fd)
        except OSError:
            continue
        if size.lines > 0 and size.columns > 0:
            return size.lines, size.columns
    return 24, 80


def _term_prefix() -> str:
    """Sets TERM for the program when the session has none (or ``dumb``): the caller's, else xterm."""
    term = os.environ.get("TERM") or ""
    if term in ("", "dumb"):
        term = "xterm"
    return f'case ${{TERM-}} in ""|dumb) export TERM={shlex.quote(term)};; esac; '


@contextlib.contextmanager
def _raw(fd: int | None) -> Iterator[None]:
    """The terminal on ``fd`` in raw mode (keys go through as bytes: Ctrl-C is 0x03); restored on the way out."""
    saved = None
    if fd is not None and os.isatty(fd):
        try:
            saved = termios.tcgetattr(fd)
            _tty.setraw(fd, termios.TCSANOW)
        except termios.error:
            saved = None
    try:
        yield
    finally:
        if saved is not None:
            with contextlib.suppress(termios.error, OSError):
                termios.tcsetattr(fd, termios.TCSADRAIN, saved)  # type: ignore[arg-type]


class _Signals:
    """While a program is on the terminal: SIGWINCH wakes the loop, SIGINT from outside becomes Ctrl-C
    on the terminal, SIGTERM and SIGHUP stop it (``_Stop``), and only get recorded once cleaning up began."""

    def __init__(self, wake_w: int) -> None:
        self.wake_w = wake_w
        self.received: int | None = None
        self.cleaning = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            handlers: dict[int, Any] = {
                signal.SIGWINCH: self._wake, signal.SIGINT: self._wake, signal.SIGTERM: self._stop,
                signal.SIGHUP: self._stop,
            }
            self._previous = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)

    def _wake(self, signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"w" if signum == signal.SIGWINCH else b"c")

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if not self.cleaning:
            raise _Stop(signum)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select.select([], [fd], [], 1.0)
        except InterruptedError:
            continue


class _Link:
    """The way to the program: a live stream where the target offers one, else the process's write() and buffer."""

    def __init__(self, proc: BackgroundProcess) -> None:
        self.proc = proc
        self.stream: Any | None = proc.open_stream()
        self._in_ok = self.stream is not None
        self.pos = 0  # output offset copied so far (the stream and the buffer count alike)
        self.last = b""  # the last byte copied

    def send(self, data: bytes) -> None:
        if self._in_ok:
            try:
                self.stream.write(data)  # type: ignore[union-attr]
                return
            except OSError:
                self._in_ok = False
        _safely(self.proc.write, data)

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()

    def copy_output(self, out_fd: int, done_w: int) -> None:
        """Copy the program's output to ``out_fd`` until it ended and its last output is written."""
        proc = self.proc
        try:
            stream = self.stream
            while stream is not None:
                try:
                    data = stream.read(_READ)
                except (OSError, ValueError):
                    data = b""
                if not data:
                    # It ended, or the stream broke: the buffer goes on from here, and keys take write().
                    self._in_ok = False
                    break
                _write_all(out_fd, data)
                self.pos += len(data)
                self.last = data[-1:]
            while True:
                chunk = proc.read(self.pos)
                if chunk.data:
                    _write_all(out_fd, chunk.data)
                    self.pos = chunk.next_offset
                    self.last = chunk.data[-1:]
                    continue
                if not proc.running:
                    # Its last output came in before its exit was reported; a child
                    # that keeps the terminal open is not waited for.
                    final = proc.read(self.pos).data
                    if final:
                        _write_all(out_fd, final)
                        self.last = final[-1:]
                    break
                proc.wait_for_more(self.pos, 0.2)
        except OSError:
            pass  # our terminal went away: the program still gets its end
        finally:
            with contextlib.suppress(OSError):
                os.write(done_w, b"d")


def run_tty(
    env: BaseEnvironment,
    command: str,
    *,
    stdin_fd: int | None = 0,
    stdout_fd: int = 1,
    cwd: str | None = None,
    timeout: float | None = None,
    newline_after: bool = False,
) -> int:
    """Run ``command`` in ``env``'s session on a pseudo-terminal wired to ``stdin_fd``/``stdout_fd``; its status.

    The command sees the session's state (cwd, exported variables, functions,
    aliases, options) as ``execute()`` gives it, on a terminal of the caller's
    size; changes it makes to that state stay with it. When ``stdin_fd`` is a
    terminal it is put in raw mode for the duration (restored on every way
    out), so Ctrl-C, Ctrl-Z and Ctrl-\\ reach the program's foreground
    process group through its own terminal, and a window-size change
    (SIGWINCH) resizes it. Input that is not a terminal is copied until its
    end, which the program then reads as Ctrl-D. SIGINT sent to this process
    from elsewhere is passed on as Ctrl-C; SIGTERM and SIGHUP end the
    command's tree, restore the terminal, and are then raised again for the
    handler that was in place (128+N when it returns). ``timeout``: end it after this many
    seconds, status 124. ``newline_after``: end a last line the program left
    open (for a prompt that follows).
    """
    rows, cols = window_size(*(fd for fd in (stdin_fd, stdout_fd) if fd is not None))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    registry = ProcessRegistry(poll=TTY_POLL, input_wait_s=None, keep_finished=4)
    signals = _Signals(wake_w)
    proc: BackgroundProcess | None = None
    code: int | None = None
    try:
        with signals:
            try:
                proc = registry.spawn(
                    env, _term_prefix() + command, pty=True, window=(rows, cols), notify_on_exit=False, cwd=cwd,
                    buffer_bytes=_BUFFER_BYTES,
                )
                code = _attach(proc, stdin_fd, stdout_fd, wake_r, wake_w, timeout, newline_after)
            except _Stop:
                pass
            finally:
                signals.cleaning = True
                if proc is not None and proc.running:
                    _end(proc)
                registry.close()
    finally:
        registry.close()
        os.close(wake_r)
        os.close(wake_w)
    if signals.received is not None:
        # Cleaned up: now the signal does what it would have done here (the CLI's handler, or the default).
        signal.raise_signal(signals.received)
        return 128 + signals.received
    if code is None:
        note = proc.note if proc is not None else None
        raise TerminalLostError(f"{env.name}: the program on the terminal was lost: {note or 'no exit status'}")
    return code


def _attach(
    proc: BackgroundProcess,
    stdin_fd: int | None,
    stdout_fd: int,
    wake_r: int,
    wake_w: int,
    timeout: float | None,
    newline_after: bool,
) -> int | None:
    link = _Link(proc)
    copier = threading.Thread(target=link.copy_output, args=(stdout_fd, wake_w), name="hermes-env-tty", daemon=True)
    try:
        with _raw(stdin_fd):
            copier.start()
            try:
                return _pump(link, stdin_fd, wake_r, timeout)
            finally:
                if proc.running:
                    _end(proc)
                link.close()
                copier.join(10.0)
                if newline_after and link.last not in (b"\n", b""):
                    with contextlib.suppress(OSError):
                        _write_all(stdout_fd, b"\r\n")
    finally:
        link.close()


def _end(proc: BackgroundProcess) -> None:
    with contextlib.suppress(HermesEnvError):
        proc.kill()


def _pump(link: _Link, stdin_fd: int | None, wake_r: int, timeout: float | None) -> int | None:
    """Keys to the program, resizes to its terminal, until its output is done; its exit status."""
    proc = link.proc
    deadline = None if timeout is None else time.monotonic() + timeout
    reading = stdin_fd is not None
    done = False
    ended_at: float | None = None
    while not done:
        fds = [wake_r] + ([stdin_fd] if reading and stdin_fd is not None else [])
        left = _LOOK_S if deadline is None else max(0.0, min(_LOOK_S, deadline - time.monotonic()))
        try:
            ready = select.select(fds, [], [], left)[0]
        except InterruptedError:
            continue
        if not proc.running:
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > _STREAM_GRACE_S:
                link.close()  # its stream did not end with it: the buffer has the rest
        if deadline is not None and time.monotonic() >= deadline and proc.running:
            _end(proc)
            proc.wait(30.0)
            return 124
        if wake_r in ready:
            try:
                events = os.read(wake_r, 64)
            except BlockingIOError:
                events = b""
            if b"w" in events and stdin_fd is not None:
                _safely(proc.set_window_size, *window_size(stdin_fd))
            if b"c" in events:
                link.send(b"\x03")
            done = b"d" in events
        if reading and stdin_fd is not None and stdin_fd in ready:
            try:
                data = os.read(stdin_fd, _READ)
            except OSError as exc:
                data = b"" if exc.errno in (errno.EIO, errno.EBADF) else None  # type: ignore[assignment]
                if data is None:
                    continue
            if data:
                link.send(data)
            else:
                reading = False
                threading.Thread(target=_eof_when_read, args=(link,), name="hermes-env-tty-eof", daemon=True).start()
    try:
        return proc.wait(30.0)
    except TimeoutError:
        return None


def _eof_when_read(link: _Link) -> None:
    """End of piped input: Ctrl-D once the program waits on its terminal with the input before it read.

    Sent at once, it would sit behind lines the program has not read yet, and
    a program that reads its terminal raw (a REPL's line editor) takes it for
    a NUL byte. Without a way to tell, it goes after a second of quiet.
    """
    proc = link.proc
    quiet_since, seen = time.monotonic(), proc.output_end
    while proc.running:
        if proc.output_end != seen:
            quiet_since, seen = time.monotonic(), proc.output_end
        if proc.check_waiting_for_input(0.1) or time.monotonic() - quiet_since > _EOF_QUIET_S:
            link.send(b"\x04")
            return
        with contextlib.suppress(TimeoutError):
            proc.wait(0.05)


def _safely(fn: Any, *args: Any) -> None:
    """A write or resize that meets a program that just ended: its end is reported by the output side."""
    with contextlib.suppress(ProcessError):
        fn(*args)


def print_state_warning(line: str) -> None:
    """On the shell's terminal lines: say which of their changes to the session will not carry over."""
    changes = state_changes(line)
    if changes:
        what = ", ".join(dict.fromkeys(changes))
        print(
            f"hermes-env: this line runs on a terminal: its {what} will not carry over to the session "
            "(run it on a line of its own)",
            file=sys.stderr,
        )


def cmd_run(args: Any, command: str) -> int:
    """``hermes-env run --tty COMMAND``: the command on a terminal; its exit status is ours."""
    from ..errors import UsageError
    from .common import environment

    for flag in ("background", "stdin", "stats"):
        if getattr(args, flag, False):
            raise UsageError(f"run: --tty and --{flag} cannot be used together")
    with environment(args, no_default_timeout=True) as env:
        return run_tty(env, command, cwd=args.cwd, timeout=env.config.timeout)
