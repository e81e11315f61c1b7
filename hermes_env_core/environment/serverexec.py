"""Runs an environment's commands through its session server, one at a time.

Owns the server, the checkpoint (refreshed while the session is idle, never
on a command's path), the out-of-band kill on a second stream, and recovery:
a lost server is replaced at the next command by a new one that gets the
checkpoint (or the state an exiting command handed back), with a note.
"""

from __future__ import annotations

import logging
import posixpath
import re
import weakref
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import BackendError, EnvironmentClosedError, EnvironmentUnavailable
from .channel import BOOT_ARGV as SCRIPT_ARGV
from .channel import ChannelStream
from .output import OutputCapture
from .server import ServerLost, ServerReport, SessionServer
from .session import SessionState, ShellSession, StateParseError, may_exit, parse_state_dump

__all__ = ["ServerRun", "ServerRunner"]

_log = logging.getLogger(__name__)
_POLL_S = 0.02
_IDLE_CHECKPOINT_S = 0.15
_DRAIN_S = 2.0
_CONTROL_TIMEOUT_S = 2.0


@dataclass
class ServerRun:
    """What one command through the server came to."""

    report: ServerReport | None
    timed_out: bool = False
    interrupted: bool = False
    cpu: tuple[float, float] | None = None
    notes: tuple[str, ...] = ()
    started: float | None = None  # monotonic time the command was sent (setup and checkpoints before it excluded)

    @property
    def notes_dir_recreated(self) -> bool:
        return self.report is not None and self.report.dir_recreated


class _Control:
    """A second stream to a bash in the target that signals a command's tree."""

    _PROGRAM = "while IFS=' ' read -r a b c d e f; do __k_main \"$a\" \"$b\" \"$c\" \"$d\" \"$e\" \"$f\"; done\n"

    def __init__(self, opener: Callable[[Sequence[str]], ChannelStream]) -> None:
        from .server import KILL_PROGRAM

        self.stuck = False
        self._stream = opener(SCRIPT_ARGV)
        program = (KILL_PROGRAM + self._PROGRAM).encode()
        self._stream.write(f"{len(program)}\n".encode() + program)
        self._buf = b""

    def signal(self, pid: int, sig: str, since_ticks: int, *, server: int, last_pid: int = 0, start_ticks: int = 0) -> int:
        """Signal the tree (``server``: 1 stops the server first, 2 also kills it, 3 signals it too);
        how many were found. ``start_ticks``: the server's start time; nothing is done to another
        process with its id. A target that does not answer in time (a paused container) raises."""
        found: list[int] = []
        failed: list[BaseException] = []

        def io() -> None:
            try:
                found.append(self._signal(f"{pid} {sig} {since_ticks} {server} {last_pid} {start_ticks}\n"))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                failed.append(exc)

        t = threading.Thread(target=io, name="hermes-env-kill", daemon=True)
        t.start()
        t.join(_CONTROL_TIMEOUT_S)
        if t.is_alive():
            # Left as it is (closing a stream into a frozen target can block): a new one is opened.
            self.stuck = True
            raise TimeoutError("the target did not answer the kill request")
        if failed:
            raise failed[0]
        return found[0]

    def _signal(self, request: str) -> int:
        self._stream.write(request.encode())
        while b"\n" not in self._buf.partition(b"killed ")[2]:
            data = self._stream.read(4096)
            if not data:
                raise BackendError("the kill stream ended")
            self._buf += data
        _, _, rest = self._buf.partition(b"killed ")
        line, _, self._buf = rest.partition(b"\n")
        return int(line) if line.isdigit() else 0

    def close(self) -> None:
        try:
            self._stream.close()
        except Exception:  # noqa: BLE001
            pass


class ServerRunner:
    """The session server of one environment."""

    def __init__(
        self,
        *,
        label: str,
        opener: Callable[[Sequence[str]], ChannelStream],
        private_dir: str,
        login: bool,
        init: str,
        default_cwd: str | None,
        excluded_prefixes: Sequence[str],
        env_id: str,
        note: Callable[[str], None],
        explain_lost: Callable[[float], tuple[int, str] | None] | None = None,
        control_first: bool = False,
    ) -> None:
        self.label = label
        self._control_first = control_first
        # Weak: the runner's threads must not keep an unclosed environment alive.
        self._note_ref = weakref.WeakMethod(note) if hasattr(note, "__self__") else (lambda: note)
        self._explain_ref: Callable[[], Callable[[float], tuple[int, str] | None] | None] = (
            weakref.WeakMethod(explain_lost) if explain_lost is not None and hasattr(explain_lost, "__self__")
            else (lambda: explain_lost)
        )
        self._opener_ref = weakref.WeakMethod(opener) if hasattr(opener, "__self__") else (lambda: opener)
        self.private_dir = private_dir
        self._login = login
        self._init = init
        self._lock = threading.Lock()
        self._server: SessionServer | None = None
        self._control: _Control | None = None
        self._commands = 0  # commands run in this session
        self._checkpoint_of = 0  # the command whose state the checkpoint holds
        self._lost: str | None = None
        self._flags = ""
        self._last_status: int | None = None  # of the last command that ended normally
        self._cpu: tuple[float, float] | None = None
        self._closed = False
        self._pending = False  # a checkpoint is due before the next command
        self._names_of: SessionState | None = None  # the state _names was worked out from
        self._names: frozenset[str] = frozenset()
        self._funcs_exit = False
        self._sweep = False  # the lost server may have left a command running
        self._cmd_started: float | None = None
        self._cmd_last_pid = 0
        self._start_error: str | None = None  # the configured directory that could not be entered
        self.session = ShellSession(
            state_dir=private_dir, default_cwd=default_cwd, excluded_prefixes=excluded_prefixes, env_id=env_id
        )
        self._idle = threading.Condition()
        self._last_end = 0.0
        self._idle_thread: threading.Thread | None = None
        #: Set before the first command to start the session from another state (a snapshot's):
        #: given the fresh shell's state, returns the one restored into the first server.
        self.start_from: Callable[[SessionState], SessionState] | None = None

    def _opener(self, argv: Sequence[str]) -> ChannelStream:
        opener = self._opener_ref()
        if opener is None:
            raise EnvironmentClosedError(f"{self.label}: the environment is gone")
        return opener(argv)

    def _note(self, text: str) -> None:
        note = self._note_ref()
        if note is not None:
            note(text)

    # -- the server --------------------------------------------------------------
    def _boot(self) -> SessionServer:
        return SessionServer(
            self._opener, private_dir=self.private_dir, login=self._login, label=self.label, init=self._init
        )

    def _ensure(self) -> SessionServer:
        """The live server (caller holds the lock): boot, or replace a lost one."""
        server = self._server
        if server is not None and server.alive:
            return server
        first = server is None and self.session.baseline is None
        handover = server.handover if server is not None else None
        why: str | None = None
        if server is not None:
            server.close()
            self._server = None
            why = self._lost or "the session server ended"
        old_pid = server.pid if server is not None and handover is None and self._sweep else 0
        old_start = server.start_ticks if server is not None else 0
        server = self._boot()
        self._server = server
        self._cpu = None
        if old_pid and self._cmd_started is not None:
            # The last server was cut off mid-command (a dropped connection): what that
            # command started may still run in the target; it goes now.
            try:
                if self._control is None:
                    self._control = _Control(self._opener)
                since = int((time.monotonic() - self._cmd_started) * 100) + 5
                if old_start and self._control.signal(
                    old_pid, "KILL", since, server=2, last_pid=self._cmd_last_pid, start_ticks=old_start
                ):
                    self._note("the processes the cut-off command had started were stopped")
            except Exception as exc:  # noqa: BLE001 - best effort
                _log.debug("%s: sweeping the lost server failed: %r", self.label, exc)
        self._sweep = False
        if self._control is None and self._control_first:
            # Opened now, while the target can start processes: a command that exhausts them
            # (a fork bomb under a pids limit) must still be stoppable.
            try:
                self._control = _Control(self._opener)
            except Exception as exc:  # noqa: BLE001 - opened again when needed
                _log.debug("%s: no control stream yet: %r", self.label, exc)
        if first and server.login_failed is not None:
            self._note(f"login shell start-up failed (exit {server.login_failed}); running without ~/.profile")
        if first:
            dump, sep, cwd = server.checkpoint()
            state = parse_state_dump(dump, sep, self.session.excluded_prefixes, cwd or None)
            self.session.set_baseline(state)
            state = self.session.interactive_defaults(state)
            given = self.start_from
            if given is not None:
                state = given(self.session.baseline or state)
            self.session.set_state(state)
            if given is not None or (state.cwd and state.cwd != cwd):
                got = self._restore(server, state)
                if got == cwd and state.cwd != cwd:
                    # The configured directory cannot be entered: the first command says so.
                    self._start_error = state.cwd
                self.session.set_state(SessionState(**{**state.__dict__, "cwd": got}))
                self.session.note_cwd(got)
            self._checkpoint_of = 0
            return server
        # A replacement: the state the last command handed back, else the checkpoint.
        source = f"the checkpoint taken after command {self._checkpoint_of}"
        if handover is not None:
            try:
                state = parse_state_dump(
                    handover[0], handover[1], self.session.excluded_prefixes, handover[2] or None,
                    names_from=self.session.baseline,
                )
                self.session.set_state(state)
                source = f"the state command {self._commands} reached"
                why = None
            except StateParseError as exc:
                _log.debug("%s: hand-over state unreadable: %s", self.label, exc)
        current = self.session.state
        if current is not None:
            if handover is None and self._last_status is not None:
                # `$?` changes with every command, the checkpoint only with those that change the state
                current = SessionState(**{**current.__dict__, "last_status": self._last_status})
            self._restore(server, current)
        if why is not None:
            self._note(f"{why}; a new session server was started with {source}")
        self._lost = None
        return server

    def _predict(self, command: str) -> tuple[bool, bool]:
        """(may the command end the shell, may it change the state), from its words and the
        session's function and alias names, worked out once per checkpoint."""
        state = self.session.state
        if state is not self._names_of:
            self._names_of = state
            funcs = frozenset(state.function_names) if state is not None else frozenset()
            aliases = frozenset(re.findall(r"^alias ([^=\s]+)=", state.aliases, re.M)) if state is not None else frozenset()
            self._names = funcs | aliases
            self._funcs_exit = state is not None and bool(state.functions) and may_exit(state.functions, None)
        words = set(re.findall(r"[\w.:+-]+", command))
        calls_ours = bool(words & self._names)
        exits = "e" in self._flags or may_exit(command, None) or (self._funcs_exit and calls_ours)
        changes = state is None or calls_ours or _CHANGES_RE.search(command) is not None
        return exits, changes

    def _run_own(self, server: SessionServer, script: str, what: str) -> ServerReport:
        """Run one of our own scripts on ``server`` to its end (its output is dropped)."""
        nonce = server.send_command(script, cwd=None, stdin=None)
        deadline = time.monotonic() + 60.0
        server.wait_started(nonce, deadline)
        report = server.read_output(nonce, lambda b: None, poll_s=0.5, should_stop=lambda: time.monotonic() > deadline)
        if report is None:
            raise EnvironmentUnavailable(f"{self.label}: {what} timed out")
        return report

    def _restore(self, server: SessionServer, state: SessionState) -> str:
        """Put ``state`` into a new server; the directory it is in then."""
        last = state.last_arg if state.last_arg is not None else "''"
        script = self.session.restore_script(
            # `&& :`: a nonzero status under errexit must not end the new server
            f"__hermes_rr() {{ builtin unset -f __hermes_rr; return $1; }}; __hermes_rr {int(state.last_status)} {last} && :",
            cd_fatal=False,
        )
        report = self._run_own(server, script, "restoring the session state in a new server")
        server.dirty = False
        return report.cwd

    # -- commands ------------------------------------------------------------------
    def run(
        self,
        command: str,
        *,
        cwd: str | None,
        stdin: bytes | None,
        timeout: float | None,
        cancel: threading.Event | None,
        closing: threading.Event,
        capture: OutputCapture,
        kill_grace_s: float,
    ) -> ServerRun:
        while not self._lock.acquire(timeout=_POLL_S):
            if closing.is_set():
                raise EnvironmentClosedError(f"{self.label}: the environment was closed")
            if cancel is not None and cancel.is_set():
                return ServerRun(None, interrupted=True, notes=("cancelled before it started: another command was running",))
        try:
            if self._closed:
                raise EnvironmentClosedError(f"{self.label}: the environment is closed")
            return self._run_locked(command, cwd, stdin, timeout, cancel, closing, capture, kill_grace_s)
        finally:
            self._last_end = time.monotonic()
            self._lock.release()
            self._wake_idle()

    def _run_locked(
        self,
        command: str,
        cwd: str | None,
        stdin: bytes | None,
        timeout: float | None,
        cancel: threading.Event | None,
        closing: threading.Event,
        capture: OutputCapture,
        kill_grace_s: float,
        retry: bool = True,
    ) -> ServerRun:
        if self._pending:
            # The last command may have changed the state and no idle moment came since:
            # read it back now, so that a timeout of this one cannot lose it.
            try:
                self._refresh()
            except (ServerLost, TimeoutError, StateParseError) as exc:
                _log.debug("%s: checkpoint before the command failed: %r", self.label, exc)
        for attempt in (0, 1):
            try:
                server = self._ensure()
                if self._start_error is not None:
                    bad, self._start_error = self._start_error, None
                    capture.feed(f"hermes-env: cannot enter working directory: {bad}\n".encode("utf-8", "surrogateescape"))
                    return ServerRun(
                        ServerReport(exit_code=126, cwd=self.session.cwd or "", cpu_times=None),
                        notes=(f"working directory {bad} is gone; session directory reset to {self.session.cwd}",),
                    )
                exits, changes = self._predict(command)
                server.inline_checkpoint = None
                nonce = server.send_command(command, cwd=cwd, stdin=stdin, may_exit=exits, checkpoint=changes)
                break
            except ServerLost as exc:
                # A new server's stream broke at once, or the server was found dead as the
                # command was sent: the command never ran; once more on a new server.
                self._lost = str(exc)
                if attempt:
                    raise
        self._commands += 1
        started = time.monotonic()
        self._cmd_started = started
        self._cmd_last_pid = 0
        deadline = started + timeout if timeout else None
        reason: str | None = None

        def should_stop() -> bool:
            nonlocal reason
            if (cancel is not None and cancel.is_set()) or closing.is_set():
                reason = "cancel"
            elif deadline is not None and time.monotonic() >= deadline:
                reason = "timeout"
            return reason is not None

        report: ServerReport | None = None
        try:
            try:
                self._cmd_last_pid = server.wait_started(
                    nonce, deadline if deadline is not None else time.monotonic() + 3600.0
                )
            except TimeoutError:
                should_stop()
            except ServerLost:
                # Lost before the command started (a connection dropped while idle): it never ran.
                self._lost = "the session server was gone"
                self._commands -= 1
                return self._run_locked(command, cwd, stdin, timeout, cancel, closing, capture, kill_grace_s, retry=False) if retry else self._raise_lost()
            if reason is None:
                report = server.read_output(nonce, capture.feed, poll_s=_POLL_S, should_stop=should_stop)
        except ServerLost as exc:
            self._lost = "the session server ended during the command"
            explain = self._explain_ref()
            explained = explain(started) if explain is not None else None
            if explained is not None and server.handover is None:
                code, why = explained
                self._lost = f"the session server was killed with the command (exit {code})"
                return ServerRun(
                    ServerReport(exit_code=code, cwd=self.session.cwd or "", cpu_times=None),
                    notes=(why,), started=started,
                )
            if server.handover is None:
                self._sweep = True
                raise BackendError(
                    f"{self.label}: the session server was lost during the command ({exc}); "
                    "the next command starts a new one from the checkpoint"
                ) from exc
        except BaseException:
            # on_output raised, or the caller was interrupted: the command must not outlive the call.
            self._stop(server, started, kill_grace_s)
            raise
        notes: list[str] = []
        if report is None and reason is not None:
            self._stop(server, started, kill_grace_s, sink=capture.feed)
            self._lost = (
                f"the command {'timed out' if reason == 'timeout' else 'was cancelled'}, which stopped the session "
                "server (background jobs it had started keep running, outside the job table)"
            )
            return ServerRun(
                None, timed_out=reason == "timeout", interrupted=reason == "cancel", notes=tuple(notes), started=started
            )
        assert report is not None
        self._flags = report.flags
        self._last_status = report.exit_code
        if server.inline_checkpoint is not None:
            self._take_checkpoint(server.inline_checkpoint)
            server.dirty = False
        self._pending = False
        cpu = None
        if report.cpu_times is not None:
            base = self._cpu or (0.0, 0.0)  # a new server: its own start-up counts in its first command
            cpu = (max(report.cpu_times[0] - base[0], 0.0), max(report.cpu_times[1] - base[1], 0.0))
            self._cpu = report.cpu_times
        if cwd is None:
            self.session.note_cwd(report.cwd)
        if server.handover is not None:
            self._lost = "the command ended the shell"
        return ServerRun(report, cpu=cpu, notes=tuple(notes), started=started)

    def _raise_lost(self) -> ServerRun:
        self._sweep = True
        raise BackendError(f"{self.label}: the session server was lost as the command started; it did not run")

    def _stop(
        self, server: SessionServer, started: float, grace: float, sink: Callable[[bytes], None] | None = None
    ) -> None:
        """Freeze the server, end the command's tree (TERM, then KILL after the grace), end the server."""
        def since() -> int:  # clock ticks (1/100 s) back to when the command was sent, and one for rounding
            return round((time.monotonic() - started) * 100) + 1

        for _attempt in (0, 1):
            try:
                if self._control is None:
                    self._control = _Control(self._opener)
                kw = {"last_pid": self._cmd_last_pid, "start_ticks": server.start_ticks}
                # The server frozen (no further statement of the command runs), SIGTERM to the
                # command's tree, then, after the grace or once nothing is left, SIGKILL to what is
                # left and to the server.
                left = self._control.signal(server.pid, "TERM", since(), server=1, **kw)
                end = time.monotonic() + grace
                while left and time.monotonic() < end:
                    time.sleep(_POLL_S)
                    left = self._control.signal(server.pid, "0", since(), server=1, **kw)
                self._control.signal(server.pid, "KILL", since(), server=2, **kw)
                break
            except Exception as exc:  # noqa: BLE001 - a stuck or broken control stream: once more on a new one
                _log.debug("%s: kill through the control stream failed: %r", self.label, exc)
                if self._control is not None and not self._control.stuck:
                    self._control.close()
                self._control = None
                self._sweep = True  # try again once the target answers
        if not _drain(server, sink):
            server.close()

    # -- checkpoint while idle ---------------------------------------------------------
    def _wake_idle(self) -> None:
        if self._idle_thread is None:
            self._idle_thread = threading.Thread(target=self._idle_loop, name=f"{self.label}-checkpoint", daemon=True)
            self._idle_thread.start()
        with self._idle:
            self._idle.notify_all()

    def _idle_loop(self) -> None:
        while not self._closed:
            with self._idle:
                self._idle.wait(5.0)
            while not self._closed:
                # Right away after a command that may have changed the state; else once idle.
                wait = 0.0 if self._pending else self._last_end + _IDLE_CHECKPOINT_S - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                    continue
                break
            if self._closed or not self._lock.acquire(blocking=False):
                continue
            try:
                self._refresh()
            except Exception as exc:  # noqa: BLE001 - the next command finds out
                _log.debug("%s: checkpoint failed: %r", self.label, exc)
            finally:
                self._lock.release()

    def _refresh(self) -> None:
        server = self._server
        if server is None or not server.alive or not server.dirty:
            return
        self._take_checkpoint(server.checkpoint(timeout=15.0))

    def _take_checkpoint(self, got: tuple[str, str, str]) -> None:
        dump, sep, cwd = got
        try:
            state = parse_state_dump(
                dump, sep, self.session.excluded_prefixes, cwd or None, names_from=self.session.baseline
            )
        except StateParseError as exc:
            self._note(f"session state not saved: {exc}")
            return
        self.session.set_state(state)
        self._checkpoint_of = self._commands
        self._pending = False

    def ensure_server(self) -> None:
        """Have a server (boot or attach one) unless the runner has one; waits for a command under way."""
        with self._lock:
            if self._server is None and not self._closed:
                self._ensure()

    def current_session(self) -> ShellSession:
        """The session with its checkpoint up to date (for processes started outside ``execute``)."""
        with self._lock:
            if not self._closed:
                self._ensure()
                self._refresh()
        return self.session

    # -- the end ------------------------------------------------------------------------
    def close(self) -> bytes:
        """End the server as ``exit`` would (the user's EXIT trap runs); returns what it printed."""
        with self._lock:
            self._closed = True
            with self._idle:
                self._idle.notify_all()
            out = b""
            if self._server is not None and self._server.alive:
                out = self._server.quit()
            elif self._server is not None:
                self._server.close()
            self._server = None
            if self._control is not None:
                self._control.close()
                self._control = None
            return out


# What can change a shell's own state (beyond the directory, which every report
# carries): assignments, builtins that set something, sourcing, function calls.
_CHANGES_RE = re.compile(
    r"=|\b(export|unset|declare|typeset|local|readonly|alias|unalias|set|shopt|trap|ulimit|umask|source|eval|"
    r"exec|hash|pushd|popd|cd|enable|shift|getopts|read|mapfile|readarray|let|printf|function|builtin|command|"
    r"complete|history|fc|bind|wait|disown|kill|jobs|fg|bg)\b|(^|[;&|(\s])\.\s|\(\)|\(\(|&"
)


def changes_state(command: str, state: SessionState | None) -> bool:
    """Whether ``command`` may change the shell's state (conservative: a false yes costs one checkpoint)."""
    if _CHANGES_RE.search(command):
        return True
    if state is None:
        return True
    words = set(re.findall(r"[\w.:+-]+", command))
    return bool(words & set(state.function_names)) or any(
        f"alias {w}=" in state.aliases for w in words
    )


def _drain(server: SessionServer, sink: Callable[[bytes], None] | None) -> bool:
    """Read what a stopped server still had in flight, until its stream ends."""
    end = time.monotonic() + _DRAIN_S
    try:
        while time.monotonic() < end:
            data = server._next(max(end - time.monotonic(), 0.01))  # noqa: SLF001 - same module family
            if data is not None and sink is not None:
                sink(data)
    except ServerLost:
        return True
    return False


def private_dir_in(parent: str) -> str:
    """An unguessable path for a session's private directory inside ``parent``."""
    return posixpath.join(parent, "hermes-env-" + secrets.token_hex(16))
