"""One background process as the agent sees it: status, output, stdin, signals, watches.

How the process is run and followed (a local child, a PTY, a detached
process inside a sandbox) is its driver's business; this class turns what the
driver reports into buffer contents and notifications.
"""

from __future__ import annotations

import enum
import re
import signal as _signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import HermesEnvError, UnsupportedOperation
from .buffer import OutputBuffer, OutputSlice
from .events import Notification, NotificationCallback, NotificationKind, Notifier
from .watch import (
    LineMatcher,
    RateLimit,
    RateLimiter,
    WatchPattern,
    WatchSpec,
    parse_watch,
)

__all__ = ["EXIT_TAIL_CHARS", "BackgroundProcess", "Driver", "ProcessError", "ProcessInfo", "ProcessStatus"]

EXIT_TAIL_CHARS = 2000
_PROMPT_CHARS = 400  # a prompt is the last partial line of at most this much output


class ProcessError(HermesEnvError):
    """An operation on a background process failed (stdin closed, process gone, ...)."""


class ProcessStatus(str, enum.Enum):
    RUNNING = "running"
    EXITED = "exited"  # ended by itself
    KILLED = "killed"  # ended after kill()
    LOST = "lost"  # recovered from a checkpoint but not the same process, or contact lost

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ProcessInfo:
    """A snapshot of one process, for listings."""

    id: str
    command: str
    status: ProcessStatus
    pid: int | None
    exit_code: int | None
    started_at: float  # time.time()
    ended_at: float | None
    backend: str
    task_id: str
    pty: bool
    detached: bool
    followed: bool
    output_bytes: int
    log_path: str | None
    note: str | None
    waiting_for_input: bool = False


class Driver(Protocol):
    """What runs and follows one process. Calls ``proc._feed`` and ``proc._finish`` from its own thread."""

    kind: str
    pid: int | None

    def start(self, proc: BackgroundProcess) -> None: ...
    def write(self, data: bytes, timeout: float) -> None: ...
    def close_stdin(self) -> None: ...
    def send_signal(self, sig: int) -> None: ...
    def kill_tree(self, grace: float) -> None: ...
    def set_window_size(self, rows: int, cols: int) -> None: ...
    def stop(self) -> None: ...
    def record(self) -> dict[str, Any]: ...


class BackgroundProcess:
    """A handle on a process started by ``ProcessRegistry.spawn`` (or re-adopted).

    Thread-safe. Output offsets count bytes since the process started.
    """

    def __init__(
        self,
        *,
        id: str,
        command: str,
        backend: str,
        task_id: str,
        env_key: str,
        driver: Driver,
        buffer: OutputBuffer,
        watch: WatchSpec = None,
        rate_limit: RateLimit,
        notify_on_exit: bool,
        notifier: Notifier,
        callbacks: tuple[NotificationCallback, ...] = (),
        pty: bool = False,
        detached: bool = False,
        started_at: float | None = None,
        log_path: str | None = None,
        kill_grace_s: float = 1.0,
        on_finish: Callable[[BackgroundProcess], None] | None = None,
    ) -> None:
        self.id = id
        self.command = command
        self.backend = backend
        self.task_id = task_id
        self.env_key = env_key
        self.pty = pty
        self.detached = detached
        self.started_at = time.time() if started_at is None else started_at
        self.log_path = log_path
        self.kill_grace_s = kill_grace_s
        self.notify_on_exit = notify_on_exit
        self._driver = driver
        self._buffer = buffer
        self._notifier = notifier
        self._callbacks = callbacks
        self._on_finish = on_finish
        self._lock = threading.RLock()
        self._status = ProcessStatus.RUNNING
        self._exit_code: int | None = None
        self._ended_at: float | None = None
        self._done = threading.Event()
        self._kill_requested = False
        self._stdin_closed = False
        self._followed = True
        self._waiting = False
        self.note: str | None = None
        self._patterns: tuple[WatchPattern, ...] = parse_watch(watch)
        self._matcher = LineMatcher(self._patterns) if self._patterns else None
        self._limiter = RateLimiter(rate_limit)
        self._watch_disabled = False
        self.notifications: list[Notification] = []

    # -- what the agent reads ----------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._driver.pid

    @property
    def status(self) -> ProcessStatus:
        return self._status

    @property
    def exit_code(self) -> int | None:
        """The exit code (128+N after signal N); None while running or when unknowable."""
        return self._exit_code

    @property
    def ended_at(self) -> float | None:
        return self._ended_at

    @property
    def running(self) -> bool:
        return self._status is ProcessStatus.RUNNING

    @property
    def waiting_for_input(self) -> bool:
        """True while it sits blocked reading its terminal (PTY processes; cleared by output or input)."""
        return self._waiting and self.running

    @property
    def followed(self) -> bool:
        """False once nobody reads its output (its environment closed while it runs detached)."""
        return self._followed and self.running

    @property
    def patterns(self) -> tuple[WatchPattern, ...]:
        return self._patterns

    @property
    def watch_disabled(self) -> bool:
        return self._watch_disabled

    @property
    def watch_stats(self) -> tuple[int, int]:
        """(matches delivered, matches suppressed by the rate limit)."""
        return self._limiter.delivered, self._limiter.suppressed

    @property
    def output_end(self) -> int:
        """Offset just past the last byte received."""
        return self._buffer.end

    @property
    def driver_kind(self) -> str:
        return self._driver.kind

    def read(self, since: int = 0, max_bytes: int | None = None) -> OutputSlice:
        """Output from offset ``since`` on (what is still in the rolling buffer)."""
        return self._buffer.read(since, max_bytes)

    @property
    def output(self) -> str:
        """Everything still in the rolling buffer, decoded."""
        return self._buffer.read(0).text

    def tail(self, chars: int = EXIT_TAIL_CHARS) -> str:
        return self._buffer.tail_text(chars)

    def check_waiting_for_input(self, quiet_s: float = 2.0) -> bool:
        """Look now: is it blocked reading its terminal, silent for ``quiet_s``? (for listings)"""
        look = getattr(self._driver, "waiting_now", None)
        if not self.pty or not self.running or look is None:
            return False
        try:
            return bool(look(quiet_s))
        except HermesEnvError:
            return False

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the process ends; its exit code. Raises TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"background process {self.id} still running after {timeout}s")
        return self._exit_code

    def wait_for_more(self, since: int, timeout: float | None = None) -> bool:
        """Block until output passes offset ``since`` or ends; True if it passed (then ``read(since)``)."""
        return self._buffer.wait(since, timeout)

    def open_stream(self) -> Any | None:
        """A live byte stream to the process (a ``ChannelStream``), where its driver can open one.

        Writes go to its stdin (its terminal) at once; reads return its output
        from its first byte on, ``b""`` once it has ended. For a person typing
        to a process in a remote target, where ``write()`` and the polls
        behind ``read()`` cost a round trip each. None when the driver cannot;
        the caller closes the stream.
        """
        opener = getattr(self._driver, "open_stream", None)
        return opener() if callable(opener) and self.running else None

    def wait_for_output(self, pattern: str | re.Pattern[str], timeout: float | None = None) -> bool:
        """Block until the output contains ``pattern`` (substring or regex); False on timeout or exit."""
        rx = pattern if isinstance(pattern, re.Pattern) else None
        deadline = None if timeout is None else time.monotonic() + timeout
        pos = self._buffer.start
        while True:
            chunk = self._buffer.read(pos, whole_chars=False)
            text = chunk.text
            if (rx.search(text) if rx is not None else (pattern in text)):  # type: ignore[operator]
                return True
            if self._buffer.closed and chunk.next_offset >= self._buffer.end:
                return False
            # Keep an overlap so a match split across two waits is found.
            pos = max(chunk.offset, chunk.next_offset - 4096)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._buffer.wait(chunk.next_offset, left)

    def info(self) -> ProcessInfo:
        return ProcessInfo(
            id=self.id,
            command=self.command,
            status=self._status,
            pid=self.pid,
            exit_code=self._exit_code,
            started_at=self.started_at,
            ended_at=self._ended_at,
            backend=self.backend,
            task_id=self.task_id,
            pty=self.pty,
            detached=self.detached,
            followed=self.followed,
            output_bytes=self._buffer.end,
            log_path=self.log_path,
            note=self.note,
            waiting_for_input=self.waiting_for_input,
        )

    # -- what the agent does -----------------------------------------------------
    def write(self, data: str | bytes, *, timeout: float = 10.0) -> None:
        """Send ``data`` to the process's stdin (to the terminal, for a PTY)."""
        self._check_running("write to")
        if self._stdin_closed:
            raise ProcessError(f"background process {self.id}: stdin is closed")
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        if raw:
            self._waiting = False
            self._driver.write(raw, timeout)

    def submit(self, line: str, *, timeout: float = 10.0) -> None:
        """Type ``line`` and Enter (``\\r`` on a PTY, ``\\n`` on a pipe)."""
        self.write(line + ("\r" if self.pty else "\n"), timeout=timeout)

    def close_stdin(self) -> None:
        """End of input: the process reads EOF (on a PTY: Ctrl-D at the start of a line)."""
        self._check_running("close stdin of")
        if not self._stdin_closed:
            self._driver.close_stdin()
            self._stdin_closed = True

    def send_signal(self, sig: int | str) -> None:
        """Send one signal to the process itself (not its children)."""
        self._check_running("signal")
        self._driver.send_signal(_signum(sig))

    def kill(self, *, grace: float | None = None, timeout: float = 15.0) -> int | None:
        """End the whole process tree (SIGTERM, SIGKILL after ``grace`` s) and wait for it."""
        with self._lock:
            if not self.running:
                return self._exit_code
            if not self._followed:
                raise ProcessError(
                    f"background process {self.id} is no longer followed (its environment is closed); "
                    "recover it from a new registry to kill it"
                )
            self._kill_requested = True
        self._driver.kill_tree(self.kill_grace_s if grace is None else grace)
        if not self._done.wait(timeout):
            raise ProcessError(f"background process {self.id} (pid {self.pid}) did not end after being killed")
        return self._exit_code

    def set_window_size(self, rows: int, cols: int) -> None:
        """Resize the PTY (the program gets SIGWINCH)."""
        if not self.pty:
            raise UnsupportedOperation(f"background process {self.id} has no terminal (spawn it with pty=True)")
        self._check_running("resize")
        self._driver.set_window_size(int(rows), int(cols))

    def add_watch(self, watch: WatchSpec) -> None:
        """Watch more patterns, from the next output on."""
        new = parse_watch(watch)
        with self._lock:
            self._patterns = self._patterns + new
            old = self._matcher
            self._matcher = LineMatcher(self._patterns)
            if old is not None:
                self._matcher.feed(old.partial())  # the line in progress (no newline: no match yet)
            self._watch_disabled = False

    def _check_running(self, what: str) -> None:
        if not self.running:
            raise ProcessError(f"cannot {what} background process {self.id}: it is {self._status.value}")

    # -- what the driver reports --------------------------------------------------
    def _waiting_for_input(self) -> None:
        """The driver saw it blocked reading its terminal after a silence: report it once."""
        with self._lock:
            if self._waiting or not self.running:
                return
            self._waiting = True
        tail = self._buffer.tail_text(_PROMPT_CHARS)
        prompt = tail.replace("\r\n", "\n").rsplit("\n", 1)[-1].replace("\r", "")
        self._emit(NotificationKind.WAITING_FOR_INPUT, prompt)

    def _feed(self, data: bytes) -> None:
        self._waiting = False
        self._buffer.append(data)
        if self._matcher is None or self._watch_disabled:
            return
        with self._lock:
            matcher = self._matcher
            hits = matcher.feed(data) if matcher is not None else []
            if hits:
                self._on_hits(hits)

    def _on_hits(self, hits: list[tuple[WatchPattern, str]]) -> None:
        lim = self._limiter.limit
        for pattern, line in hits:
            if self._watch_disabled:
                return
            verdict = self._limiter.check()
            if verdict == "deliver":
                self._emit(
                    NotificationKind.MATCH,
                    line[:EXIT_TAIL_CHARS],
                    pattern=str(pattern),
                    suppressed=self._limiter.take_pending(),
                )
            elif verdict == "disable":
                self._watch_disabled = True
                n = self._limiter.suppressed
                self._emit(
                    NotificationKind.WATCH_DISABLED,
                    f"watch disabled: output matched more than {lim.max_matches} times per {lim.window_s:g} s "
                    f"for {lim.disable_after_s:g} s; {n} matches were suppressed",
                    suppressed=n,
                )

    def _finish(
        self,
        exit_code: int | None,
        *,
        status: ProcessStatus | None = None,
        note: str | None = None,
        output_done: bool = True,
    ) -> None:
        """The process ended (or was lost). Idempotent: only the first call counts.

        ``output_done=False``: a child of it still holds its output open; the
        driver calls ``_output_ended()`` at the end of that.
        """
        with self._lock:
            if self._status is not ProcessStatus.RUNNING:
                return
            if self._matcher is not None and not self._watch_disabled:
                hits = self._matcher.flush()
                if hits:
                    self._on_hits(hits)
            if status is None:
                status = ProcessStatus.KILLED if self._kill_requested else ProcessStatus.EXITED
            self._exit_code = exit_code
            self._ended_at = time.time()
            self._status = status
            if note:
                self.note = note
        if status is ProcessStatus.LOST:
            self._emit(NotificationKind.LOST, note or "process lost", status=status.value, exit_code=exit_code)
        elif self.notify_on_exit:
            self._emit(
                NotificationKind.EXIT, self._buffer.tail_text(EXIT_TAIL_CHARS), exit_code=exit_code, status=status.value
            )
        if output_done:
            self._output_ended()
        try:
            if self._on_finish is not None:
                self._on_finish(self)  # the registry records it first: wait() returns to a settled state
        finally:
            self._done.set()

    def _output_ended(self) -> None:
        self._buffer.close()
        self._buffer.close_log()

    def _unfollow(self, note: str) -> None:
        """Stop following a process that keeps running (detached; its environment closed)."""
        self._followed = False
        self.note = note
        self._driver.stop()
        self._buffer.close()

    def _emit(self, kind: NotificationKind, text: str, **fields: Any) -> None:
        note = self._notifier.make(kind, self.id, text, command=self.command, **fields)
        self.notifications.append(note)
        self._notifier.emit(note, self._callbacks)

    def __repr__(self) -> str:
        code = "" if self._exit_code is None else f" exit_code={self._exit_code}"
        return f"<BackgroundProcess {self.id} pid={self.pid} {self._status.value}{code} {self.command[:40]!r}>"


def _signum(sig: int | str) -> int:
    if isinstance(sig, int):
        return sig
    name = sig.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(getattr(_signal, name))
    except AttributeError:
        raise ValueError(f"unknown signal {sig!r}") from None


class NotOursDriver:
    """Stands in for a checkpointed process that is not ours (any more): every operation refuses."""

    kind = "lost"

    def __init__(self, rec: dict[str, Any]) -> None:
        self.pid: int | None = rec.get("pid")
        self._rec: dict[str, Any] = {k: rec[k] for k in ("driver", "pid", "start_time", "dir") if k in rec}

    def start(self, proc: BackgroundProcess) -> None:
        pass

    def _refuse(self, *args: object) -> None:
        raise ProcessError(f"pid {self.pid} is not a process of ours any more; refusing to touch it")

    write = close_stdin = send_signal = kill_tree = set_window_size = _refuse

    def stop(self) -> None:
        pass

    def record(self) -> dict[str, Any]:
        return dict(self._rec)
