"""Commands run through the daemon's session API: started with one short request, then followed.

A command never rides on one long HTTP request: load balancers in front of
the service cut those, and a request the SDK sends again runs the command
again. ``execute_session_command(run_async=True)`` returns the command's id
at once; its exit status (``get_session_command``) and output
(``get_session_command_logs``) are then asked for with short requests until
both are there. Each session runs one command at a time (a session is one
shell reading its commands in order), so concurrent commands take separate
sessions from a small pool.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from hermes_env_core.environment.handles import Writer
from hermes_env_core.errors import BackendError

from . import _sdk

if TYPE_CHECKING:
    from .backend import DaytonaEnvironment

__all__ = ["CommandFollower", "SessionPool", "StartedCommand", "no_bash"]

#: How long the output may lag behind the exit status before the frame is given up on.
OUTPUT_GRACE_S = 2.0
#: How long the exit status may lag behind the command's own end-of-output record.
STATUS_GRACE_S = 30.0
_FIRST_POLL_S = 0.002
_LONGEST_POLL_S = 0.5
_POLL_REQUEST_TIMEOUT_S = 30.0
#: Without live output, the logs are looked at now and then (bounded work for a long command).
_FIRST_LOOK_S = 1.0
#: For this long after the start the output is read with every status poll.
_EAGER_S = 1.0
_LONGEST_LOOK_S = 30.0
_TRANSIENT_ATTEMPTS = 4


class StartedCommand:
    """A command the daemon accepted: where it runs and its id."""

    __slots__ = ("cmd_id", "sandbox", "session_id")

    def __init__(self, sandbox: Any, session_id: str, cmd_id: str) -> None:
        self.sandbox = sandbox
        self.session_id = session_id
        self.cmd_id = cmd_id


class SessionPool:
    """Idle daemon sessions per sandbox; a session holds one running command at a time."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._idle: dict[str, list[str]] = {}

    def take(self, sandbox: Any) -> tuple[str, bool]:
        """A session id for ``sandbox`` and whether it still has to be created."""
        with self._lock:
            idle = self._idle.get(sandbox.id)
            if idle:
                return idle.pop(), False
        return f"{self._prefix}-{secrets.token_hex(6)}", True

    def give_back(self, sandbox_id: str, session_id: str) -> None:
        with self._lock:
            self._idle.setdefault(sandbox_id, []).append(session_id)

    def forget(self, sandbox_id: str) -> list[str]:
        """Drop the sessions of a sandbox (restarted or gone: the daemon lost them); their ids."""
        with self._lock:
            return self._idle.pop(sandbox_id, [])


class CommandFollower:
    """Waits for a started command's exit status and output, writing the output as it comes.

    ``end`` is the session wrapper's end-of-frame line (None for a helper
    script), ``trailer`` the line the session command prints after bash has
    exited: the output is whole when either has arrived, and nothing after it
    (a background child's late output) is passed on. ``live``: stream output while the command runs (the
    logs are asked for on every poll), else only once it has ended.
    """

    def __init__(
        self,
        env: DaytonaEnvironment,
        started: StartedCommand,
        *,
        end: str | None,
        trailer: str,
        write: Writer,
        live: bool,
        stop: threading.Event,
        forced: threading.Event,
        note: Callable[[str], None],
        spawn: Callable[[Callable[[], None]], Future[None]],
    ) -> None:
        self._env = env
        self._cmd = started
        self._end = end
        self._trailer = trailer
        self.framed = False  # the wrapper's end-of-frame line was seen
        self._write = write
        self._live = live
        self._stop = stop
        self._forced = forced
        self._note = note
        self._spawn = spawn
        self._emitted = 0  # characters of the logs' output already written
        self.output = ""  # the output as last read
        self.ended = False  # an end line was seen (the frame's or the trailer)

    # -- requests ---------------------------------------------------------------------------------
    def _ask(self, what: str, fn: Callable[[], Any]) -> Any:
        """An idempotent GET, retried on transport trouble, overload and 5xx."""
        sdk = self._env._sdk
        delay = 0.2
        for attempt in range(1, _TRANSIENT_ATTEMPTS + 1):
            try:
                return _sdk.call_with_rate_limit(fn)
            except sdk.DaytonaError as exc:
                status = getattr(exc, "status_code", None)
                transient = status is None or (isinstance(status, int) and status >= 500)
                if status in (400, 404):
                    state = self._env._state_now()
                    if state != "started":
                        raise BackendError(
                            f"daytona: {what}: sandbox {self._env.sandbox_name} is {state} (it stopped while the "
                            "command ran); the command's exit status is unknown"
                        ) from exc
                    if status == 404:
                        raise BackendError(
                            f"daytona: {what}: the daemon no longer knows the command's session (it restarted "
                            "while the command ran); the command's exit status is unknown"
                        ) from exc
                if not transient or attempt == _TRANSIENT_ATTEMPTS:
                    raise self._env._error(exc, what, BackendError) from exc
            if self._stop.wait(delay):
                raise _Stopped
            delay *= 2
        raise AssertionError("unreachable")

    def _status(self) -> int | None:
        c = self._cmd
        cmd = self._ask(
            "asking for the command's exit status",
            lambda: c.sandbox.process.get_session_command(
                c.session_id, c.cmd_id, request_timeout=_POLL_REQUEST_TIMEOUT_S
            ),
        )
        code = getattr(cmd, "exit_code", None)
        return None if code is None else int(code)

    def _pull_output(self, *, final: bool) -> None:
        c = self._cmd
        logs = self._ask(
            "reading the command's output",
            lambda: c.sandbox.process.get_session_command_logs(
                c.session_id, c.cmd_id, request_timeout=_POLL_REQUEST_TIMEOUT_S
            ),
        )
        text = getattr(logs, "output", None)
        if text is None:
            text = (getattr(logs, "stdout", None) or "") + (getattr(logs, "stderr", None) or "")
        self.output = text
        self._emit(text, final=final)

    def _emit(self, text: str, *, final: bool) -> None:
        if self.ended:
            return
        stop = len(text)
        start = max(0, self._emitted - len(self._trailer))
        hit, idx = None, -1
        for marker in (self._end, self._trailer):
            if marker is not None:
                i = text.find(marker, start)
                if i >= 0 and (idx < 0 or i < idx):
                    hit, idx = marker, i
        if hit is not None:
            # The frame's end line is the base class's to read; the session line's trailer is ours.
            stop = idx + len(hit) if hit == self._end else idx
            self.ended = True
            self.framed = hit == self._end
        elif not final:
            # Keep back what may be the start of an end line, or a character the daemon
            # could not decode yet (split across two writes).
            keep = max(_partial_suffix(text, m) for m in (self._end, self._trailer) if m is not None)
            while stop - keep > self._emitted and text[stop - keep - 1] == "\ufffd" and keep < 4:
                keep += 1
            stop -= keep
        if stop > self._emitted:
            self._write(text[self._emitted : stop].encode("utf-8", "surrogateescape"))
            self._emitted = stop

    # -- the wait -----------------------------------------------------------------------------------
    def wait(self) -> int | None:
        """The exit status the daemon reports, or None when it never came (see the notes)."""
        try:
            return self._wait()
        except _Stopped:
            return None

    def _wait(self) -> int | None:
        delay = _FIRST_POLL_S
        code: int | None = None
        started = time.monotonic()
        look_every, last_look = _FIRST_LOOK_S, started
        while True:
            now = time.monotonic()
            # While the output is young (and small), or shown live, it is read with each
            # status poll, in parallel: a short command then costs two round trips after
            # its start, not three. Later only now and then: it shows whether bash has
            # ended even while the exit status lags.
            look = self._live or now - started < _EAGER_S or now - last_look >= look_every
            if look and now - started >= _EAGER_S:
                last_look, look_every = now, min(look_every * 2, _LONGEST_LOOK_S)
            pending = self._spawn(lambda: self._pull_output(final=False)) if look else None
            try:
                code = self._status()
            finally:
                if pending is not None:
                    pending.result()
            if code is not None:
                break
            if self.ended:
                code = self._status_after_frame()
                break
            if self._stop.wait(delay):
                raise _Stopped
            delay = min(delay * 2, _LONGEST_POLL_S)
        if code is not None and self.ended:
            return code
        if code == 127 and _no_bash(self.output):
            return code  # bash never started: no record will come
        # Ended: the output may still lag behind the exit status.
        deadline = time.monotonic() + OUTPUT_GRACE_S
        delay = _FIRST_POLL_S
        while True:
            self._pull_output(final=False)
            if self.ended or time.monotonic() >= deadline:
                break
            if (code == 127 and _no_bash(self.output)) or self._forced.is_set():
                break  # no end record will come
            if self._stop.wait(delay):
                raise _Stopped
            delay = min(delay * 2, _LONGEST_POLL_S)
        if not self.ended:
            self._pull_output(final=True)
        return code

    def _status_after_frame(self) -> int | None:
        """The exit status once the command has written its end record (bash is exiting)."""
        deadline = time.monotonic() + STATUS_GRACE_S
        delay = _FIRST_POLL_S
        while True:
            code = self._status()
            if code is not None:
                return code
            if time.monotonic() >= deadline:
                self._note(
                    f"the daemon had not reported the exit status {STATUS_GRACE_S:g}s after the command ended; "
                    "the status the command's own shell recorded is used"
                )
                return None
            if self._stop.wait(delay):
                raise _Stopped
            delay = min(delay * 2, _LONGEST_POLL_S)


class _Stopped(Exception):
    """The handle was killed: stop following."""


def no_bash(output: str) -> bool:
    """Whether ``output`` is a shell saying that there is no bash to run."""
    head = output[:2000].split("\x1ehermes-end:", 1)[0]
    return "\x1e" not in head and "bash" in head and "not found" in head


_no_bash = no_bash


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
