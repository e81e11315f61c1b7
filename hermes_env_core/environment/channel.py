"""The resident shell channel: a small bash server on one long-lived byte stream.

A target that can keep one bidirectional stream to a bash open offers it
(``ChannelStream``); the core sends the server program over it and then runs
every command as a fresh child ``bash -c`` of that server, with the same
wrapped script the process-per-command path runs. What it saves is the
target's exec call per command.

Wire format. Client to server: a header line, then payload bytes (the script;
stdin as ``printf %b`` text, so NUL travels as ``\\0000``). Server to client:
the command's output, raw, through a per-command relay, ended by report lines
that start with 0x1e, a per-channel secret nonce and ``:``. After the exit
report the client acknowledges; the server then kills that command's relay
(a background writer left behind gets EPIPE) and says ``D``: bytes between
the report and ``D`` are late background output and are dropped.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from importlib import resources
from typing import IO, Protocol, runtime_checkable

from ..errors import BackendError, EnvironmentClosedError, EnvironmentUnavailable
from .result import Usage

__all__ = [
    "BOOT_ARGV",
    "Channel",
    "ChannelCommand",
    "ChannelNotStarted",
    "ChannelPool",
    "ChannelRefused",
    "ChannelStream",
    "PipeStream",
    "SERVER_MIN_BASH",
]

_log = logging.getLogger(__name__)

#: The oldest bash the server runs on (major * 100 + minor).
SERVER_MIN_BASH = 404
#: What a target runs for a channel: a bash that reads the server program
#: (length line, then the program) from its stdin and runs it.
BOOT_ARGV: tuple[str, ...] = (
    "bash",
    "-c",
    'IFS= read -r __hc_n && LC_ALL=C IFS= read -r -N "$__hc_n" __hc_p && eval "$__hc_p"',
)
_HELLO_TIMEOUT_S = 30.0
_READ = 1 << 16
_MAX_STARTUP_NOISE = 1 << 20
_EXIT_CHECK_MS = 200  # how often a quiet stream checks that its server process lives


@runtime_checkable
class ChannelStream(Protocol):
    """One long-lived bidirectional byte stream to a bash in the target.

    What a backend returns from ``_open_channel(argv)``: ``argv`` is running
    in the target with its stdin fed by ``write`` and its stdout read by
    ``read`` (stderr goes anywhere but into ``read``).
    """

    def read(self, n: int) -> bytes:
        """Block until some bytes arrive; b"" once the stream has ended."""
        ...

    def write(self, data: bytes) -> None:
        """Send all of ``data``; raise ``OSError`` when the stream is broken."""
        ...

    def close(self) -> None:
        """End the stream and let go of the process behind it (idempotent)."""
        ...


class PipeStream:
    """A ``ChannelStream`` over a child process's stdin and stdout pipes.

    ``exited()`` (e.g. ``lambda: proc.poll() is not None``) ends the stream
    when the server process is gone even though a command's relay still holds
    its stdout open.

    ``close()`` may come from another thread while a read waits. It wakes the
    read and closes the pipes only once no read or write is using their
    descriptor numbers: a number closed while a read still held it could be
    given to the next stream's pipe at once, and that read would then take
    the next server's bytes.
    """

    def __init__(
        self,
        stdin: IO[bytes],
        stdout: IO[bytes],
        on_close: Callable[[], None] | None = None,
        exited: Callable[[], bool] | None = None,
    ) -> None:
        self._in, self._out, self._on_close, self._exited = stdin, stdout, on_close, exited
        self._rfd = stdout.fileno()
        self._wfd = stdin.fileno()
        self._closed = False
        self._reading = threading.Lock()  # held while a read uses self._rfd
        self._writing = threading.Lock()  # held while a write uses self._wfd
        self._closing = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._poller = select.poll()
        self._poller.register(self._rfd, select.POLLIN | select.POLLHUP | select.POLLERR)
        self._poller.register(self._wake_r, select.POLLIN)

    def read(self, n: int) -> bytes:
        with self._reading:
            while not self._closed:
                try:
                    ready = {fd for fd, _ in self._poller.poll(_EXIT_CHECK_MS if self._exited else None)}
                except OSError:
                    return b""
                if self._wake_r in ready or self._closed:
                    return b""
                if self._rfd in ready:
                    try:
                        return os.read(self._rfd, n)  # ready: never blocks
                    except OSError:
                        return b""
                if self._exited is not None and self._exited():
                    return b""
            return b""

    def write(self, data: bytes) -> None:
        with self._writing:
            if self._closed:
                raise BrokenPipeError("the stream is closed")
            view = memoryview(data)
            while view:
                view = view[os.write(self._wfd, view) :]

    def close(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")  # a read waiting in poll returns now
        if self._on_close is not None:
            self._on_close()  # the process ends: a write blocked on a full pipe gets EPIPE
        with self._reading, self._writing:
            for f in (self._in, self._out):
                try:
                    f.close()
                except OSError:
                    pass
            os.close(self._wake_r)
            os.close(self._wake_w)


class ChannelNotStarted(BackendError):
    """The channel died before the server had the command: safe to run it again."""


class ChannelRefused(Exception):
    """The target's bash cannot run the server (too old, no ``cat``): use processes."""


def _server_program(nonce: str) -> bytes:
    text = resources.files(__package__).joinpath("channel_server.sh").read_text(encoding="utf-8")
    return text.replace("@NONCE@", nonce).replace("@MINVER@", str(SERVER_MIN_BASH)).encode()


def escape_stdin(data: bytes) -> bytes:
    """``data`` as ``printf %b`` text: only backslash and NUL need escaping."""
    return data.replace(b"\\", b"\\\\").replace(b"\x00", b"\\0000")


class ChannelCommand:
    """One command running through a channel; satisfies ``ProcessHandle``.

    Output arrives on ``stdout`` (a pipe, so the caller's reads bound the
    memory: a full pipe stalls the relay in the target). ``wait`` raises
    ``BackendError`` when the channel died under the command.
    """

    def __init__(self, channel: Channel, cid: int) -> None:
        self.channel = channel
        self.cid = cid
        r, w = os.pipe()
        _widen(w)
        self.stdout: IO[bytes] | None = os.fdopen(r, "rb", buffering=0)
        self._w = w
        self._wlock = threading.Lock()
        self.returncode: int | None = None
        self.error: BaseException | None = None
        self.killed = False
        self.notes: tuple[str, ...] = ()
        #: the server has the whole request (a channel lost before that never ran it)
        self.delivered = False
        self._begin: bytes | None = None  # output before this marker is startup noise
        self._pre = b""
        self.started = time.time()
        #: CPU of the command's tree as the target counted it (no peak memory: bash cannot tell)
        self.usage: Usage | None = None
        #: called once with (self, exit code) before ``wait`` returns it; may raise ``BackendError``
        self.on_exit: Callable[[ChannelCommand, int], None] | None = None
        self._done = threading.Event()

    # -- fed by the channel's reader ----------------------------------------
    def _feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        with self._wlock:
            while view and self._w >= 0:
                try:
                    view = view[os.write(self._w, view) :]
                except OSError:
                    self._close_w()  # the reader is gone: drop the rest
                    return

    def _close_w(self) -> None:
        w, self._w = self._w, -1
        if w >= 0:
            os.close(w)

    def _finish(self, code: int | None, error: BaseException | None = None) -> None:
        self.returncode = code
        self.error = error
        with self._wlock:
            self._close_w()
        self._done.set()

    # -- ProcessHandle --------------------------------------------------------
    def poll(self) -> int | None:
        if not self._done.is_set():
            return None
        return -1 if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise TimeoutError("command still running")
        if isinstance(self.error, ChannelNotStarted):
            raise self.error
        if self.error is not None:
            raise BackendError(str(self.error)) from self.error
        assert self.returncode is not None
        if self.on_exit is not None:
            hook, self.on_exit = self.on_exit, None
            hook(self, self.returncode)
        return self.returncode

    def terminate(self) -> None:
        self.killed = True
        self.channel._signal(self, "TERM")

    def kill(self) -> None:
        self.killed = True
        self.channel._signal(self, "KILL")


class Channel:
    """One server in the target, running one command at a time."""

    def __init__(self, stream: ChannelStream, *, label: str = "channel") -> None:
        self._stream = stream
        self.label = label
        self._nonce = secrets.token_hex(12)
        self._mark = b"\x1e" + self._nonce.encode() + b":"
        self._wlock = threading.Lock()
        self._lock = threading.Lock()
        self._usage: Usage | None = None
        self._queue: deque[ChannelCommand] = deque()  # sent, report not yet seen
        self._ending: int | None = None  # id whose D is awaited (late output dropped)
        self._next_id = 0
        self._hello = threading.Event()
        self.refused: str | None = None
        self.dead: str | None = None
        self.server_pid: int | None = None
        self.bash_version = ""
        self.last: ChannelCommand | None = None  # the latest command sent
        #: called by the reader with (channel, command) once a command has reported
        self.on_report: Callable[[Channel, ChannelCommand], None] | None = None
        self._thread = threading.Thread(target=self._reader, name=f"hermes-{label}", daemon=True)
        program = _server_program(self._nonce)
        try:
            self._send(b"%d\n" % len(program) + program)
        except OSError as exc:
            stream.close()
            raise EnvironmentUnavailable(f"{label}: cannot send the server program: {exc}") from exc
        self._thread.start()
        if not self._hello.wait(_HELLO_TIMEOUT_S):
            self.close()
            raise EnvironmentUnavailable(f"{label}: the server did not start within {_HELLO_TIMEOUT_S:g}s")
        if self.refused is not None:
            self.close()
            raise ChannelRefused(self.refused)
        if self.dead is not None:
            raise EnvironmentUnavailable(f"{label}: the server did not start: {self.dead}")

    @property
    def busy(self) -> bool:
        """A command is running (its exit report not yet seen)."""
        return bool(self._queue)

    # -- commands ---------------------------------------------------------------
    def start(
        self, script: str, *, login: bool, stdin_data: bytes | None, strip_startup: bool = False
    ) -> ChannelCommand:
        """Send one command. ``strip_startup``: the target's bash may print
        before the script runs (an rc file sourced under sshd); drop that."""
        begin = None
        if strip_startup:
            token = secrets.token_hex(8)
            begin = b"\x1e" + token.encode() + b":B\n"
            # Same first line, so bash numbers the script's lines as before.
            script = f"builtin printf '\\036%s:B\\n' {token}; " + script
        body = script.encode("utf-8", "surrogateescape")
        if b"\x00" in body:
            raise ValueError("embedded null byte in the command script")
        stdin = escape_stdin(stdin_data) if stdin_data is not None else b""
        with self._lock:
            if self.dead is not None:
                raise EnvironmentUnavailable(f"{self.label} is gone: {self.dead}")
            self._next_id += 1
            cmd = ChannelCommand(self, self._next_id)
            cmd._begin = begin
            self.last = cmd
            self._queue.append(cmd)
        head = b"R %d %d %d %d\n" % (cmd.cid, 1 if login else 0, len(body), len(stdin) if stdin_data is not None else -1)
        try:
            if len(stdin) <= 65536:
                self._send(head + body + stdin)
            else:
                self._send(head + body)
                # Large stdin from a thread: the command may be writing output
                # while it reads, and the caller must be free to drain it.
                threading.Thread(target=self._send_quietly, args=(stdin,), daemon=True).start()
        except OSError as exc:
            self._die(f"the stream broke: {exc}")
        return cmd

    def _send_quietly(self, data: bytes) -> None:
        try:
            self._send(data)
        except OSError as exc:
            self._die(f"the stream broke: {exc}")

    def _send(self, data: bytes) -> None:
        with self._wlock:
            self._stream.write(data)

    def _signal(self, cmd: ChannelCommand, sig: str) -> None:
        if cmd._done.is_set() or self.dead is not None:
            return
        try:
            self._send(b"K %d %s\n" % (cmd.cid, sig.encode()))
        except OSError as exc:
            self._die(f"the stream broke: {exc}")

    def close(self) -> None:
        if self.dead is None:
            try:
                self._send(b"Q\n")
            except OSError:
                pass
        self._die("closed")

    # -- the reader -------------------------------------------------------------
    def _die(self, why: str) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = why
            pending = list(self._queue)
            self._queue.clear()
        self._hello.set()
        try:
            self._stream.close()
        except Exception:  # noqa: BLE001 - already broken
            pass
        for cmd in pending:
            if cmd.delivered:
                cmd._finish(None, BackendError(f"{self.label} to the target was lost while the command ran: {why}"))
            else:
                cmd._finish(None, ChannelNotStarted(f"{self.label} was lost before the command started: {why}"))

    def _reader(self) -> None:
        buf = b""
        mark = self._mark
        try:
            while True:
                data = self._stream.read(_READ)
                if not data:
                    self._die("the stream ended (the server or the target is gone)")
                    return
                buf = buf + data if buf else data
                buf = self._parse(buf, mark)
        except Exception as exc:  # noqa: BLE001 - a reader failure ends the channel
            _log.debug("%s reader failed", self.label, exc_info=True)
            self._die(f"reading failed: {exc!r}")

    def _parse(self, buf: bytes, mark: bytes) -> bytes:
        """Consume ``buf``; return the tail that may be an incomplete marker line."""
        while buf:
            idx = buf.find(mark)
            if idx < 0:
                keep = _partial_suffix(buf, mark)
                self._route(buf[: len(buf) - keep] if keep else buf)
                return buf[len(buf) - keep :] if keep else b""
            if idx:
                self._route(buf[:idx])
            nl = buf.find(b"\n", idx + len(mark))
            if nl < 0:
                if len(buf) - idx > 4096:
                    raise BackendError("malformed server line")
                return buf[idx:]
            line = buf[idx + len(mark) : nl].decode("utf-8", "replace")
            if line.startswith("U"):
                # `times`: this line is the runner's own, the next its children's.
                nl2 = buf.find(b"\n", nl + 1)
                if nl2 < 0:
                    return buf[idx:]
                self._usage = _parse_times(buf[nl + 1 : nl2].decode("ascii", "replace"))
                buf = buf[nl2 + 1 :]
                continue
            self._message(line)
            buf = buf[nl + 1 :]
        return b""

    def _route(self, data: bytes) -> None:
        """Output bytes: to the running command, or dropped (late background output)."""
        if not data or self._ending is not None:
            return
        cmd = self._queue[0] if self._queue else None
        if cmd is None:
            return
        if cmd._begin is not None:
            pre = cmd._pre + data
            idx = pre.find(cmd._begin)
            if idx < 0:
                cmd._pre = pre[-_MAX_STARTUP_NOISE:]
                return
            data, cmd._begin, cmd._pre = pre[idx + len(cmd._begin) :], None, b""
        cmd._feed(data)

    def _message(self, line: str) -> None:
        kind, rest = line[:1], line[1:]
        if kind == "X":
            cid_s, _, rc_s = rest.partition(" ")
            with self._lock:
                cmd = self._queue[0] if self._queue else None
                if cmd is None or str(cmd.cid) != cid_s:
                    raise BackendError(f"exit report for an unknown command: {line!r}")
                self._queue.popleft()
                self._ending = cmd.cid
            cmd.usage, self._usage = self._usage, None
            on_report = self.on_report
            if cmd._begin is not None and cmd._pre:
                cmd._feed(cmd._pre)  # the script never started: show what bash said
            # Acknowledge first, so that a command sent next finds the relay gone.
            self._send(b"A %d\n" % cmd.cid)
            cmd._finish(int(rc_s))
            if on_report is not None:
                on_report(self, cmd)  # free for the next command
        elif kind == "S":
            for cmd in self._queue:
                if str(cmd.cid) == rest:
                    cmd.delivered = True
        elif kind == "D":
            if self._ending is not None and str(self._ending) == rest:
                self._ending = None
        elif kind == "H":
            pid, _, version = rest.partition(" ")
            self.server_pid, self.bash_version = int(pid), version
            self._hello.set()
        elif kind == "N":
            self.refused = rest
            self._hello.set()
        else:
            raise BackendError(f"unknown server line: {line!r}")


class ChannelPool:
    """Channels of one environment: one per concurrent command, up to ``limit``.

    ``opener`` starts ``BOOT_ARGV`` in the target and returns its stream. A
    refused server turns the pool off for good (``refused``); a failed open
    is left to the caller (it runs the command as a process instead).
    """

    def __init__(self, opener: Callable[[Sequence[str]], ChannelStream], *, limit: int, label: str) -> None:
        self._opener = opener
        self.limit = max(1, limit)
        self.label = label
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._learned = False  # the limit is the target's, learned from a refusal
        self.closed = False
        self._idle: list[Channel] = []
        self._all: list[Channel] = []
        self._opening = 0
        self.refused: str | None = None
        self.opened = 0
        self.lost: list[str] = []  # why channels died since last asked (for notes)
        self.lost_pids: list[int] = []  # their servers' pids, which may still run (orphans)

    def acquire(self, wait_s: float = 3600.0) -> Channel | None:
        """A free channel, opened if needed; at the limit, wait for one to be
        free (like a connection pool). None when refused (or waited too long).

        When the target refused one more stream while others are open (an
        sshd's MaxSessions), that number becomes the limit.
        """
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                if self.refused is not None:
                    return None
                while self._idle:
                    ch = self._idle.pop()
                    if ch.dead is None:
                        ch.last = None
                        return ch
                    self._forget(ch)
                if len(self._all) + self._opening < self.limit:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if self.closed:
                    raise EnvironmentClosedError(f"{self.label}: the environment is closing")
                self._cond.wait(min(left, 0.1))
            self._opening += 1
        try:
            ch = Channel(self._opener(BOOT_ARGV), label=f"{self.label} channel")
        except ChannelRefused as exc:
            with self._cond:
                self.refused = str(exc)
            return None
        except EnvironmentUnavailable:
            with self._cond:
                if self._all:
                    self.limit, self._learned = len(self._all), True
            if self._learned:
                return self.acquire(max(deadline - time.monotonic(), 0.0))
            raise
        finally:
            with self._cond:
                self._opening -= 1
        ch.on_report = self.release
        with self._cond:
            self._all.append(ch)
            self.opened += 1
        return ch

    def try_acquire(self) -> Channel | None:
        """An idle channel now, or None (never opens one, never waits): for helpers."""
        with self._cond:
            while self._idle and not self.closed and self.refused is None:
                ch = self._idle.pop()
                if ch.dead is None:
                    ch.last = None
                    return ch
                self._forget(ch)
        return None

    def release(self, ch: Channel, cmd: ChannelCommand) -> None:
        """``cmd`` is over for its caller: ``ch`` may take the next command,
        unless the command never reported (then the channel is closed)."""
        if cmd.poll() is None and ch.dead is None:
            ch._die("a command did not report after being killed")
        with self._cond:
            if ch.dead is not None:
                self._forget(ch)
            elif ch.last is cmd and ch not in self._idle:
                # (Only for its latest command: a late second release must not
                # free a channel that another caller already took.)
                ch.last = None
                self._idle.append(ch)
            self._cond.notify()

    def _forget(self, ch: Channel) -> None:
        if ch in self._all:
            self._all.remove(ch)
            if ch.dead and ch.dead != "closed":
                self.lost.append(ch.dead)
                if ch.server_pid:
                    self.lost_pids.append(ch.server_pid)

    def take_lost(self) -> list[str]:
        """Why channels died since the last call (each reason once)."""
        with self._lock:
            for ch in [c for c in self._all if c.dead is not None]:
                self._forget(ch)
                if ch in self._idle:
                    self._idle.remove(ch)
            lost, self.lost = self.lost, []
        return lost

    def take_lost_pids(self) -> list[int]:
        """Server pids of channels lost since the last call (call after ``take_lost``)."""
        with self._lock:
            pids, self.lost_pids = self.lost_pids, []
        return pids

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
            chans, self._all, self._idle = list(self._all), [], []
        for ch in chans:
            ch.close()


def _partial_suffix(data: bytes, marker: bytes) -> int:
    """Length of the longest suffix of ``data`` that is a proper prefix of ``marker``."""
    start = data.rfind(marker[:1], max(0, len(data) - len(marker) + 1))
    while start >= 0:
        if marker.startswith(data[start:]):
            return len(data) - start
        start = data.find(marker[:1], start + 1)
    return 0


def _parse_times(line: str) -> Usage | None:
    """``0m1.250s 0m0.031s`` (user, system) as a ``Usage``."""
    try:
        user, system = (int(m) * 60 + float(sec.rstrip("s")) for m, _, sec in (w.partition("m") for w in line.split()))
    except ValueError:
        return None
    return Usage(cpu_user_s=user, cpu_system_s=system)


def _widen(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (OSError, ImportError):
        pass
