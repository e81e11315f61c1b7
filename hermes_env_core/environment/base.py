"""BaseEnvironment: the one ``execute()`` flow every backend runs through.

A backend supplies how to start bash (``_run_bash``) and how to let go of its
resources (``cleanup``); state, timeouts, cancel, stdin and output live here.
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import posixpath
import secrets
import select
import shlex
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..errors import BackendError, EnvironmentClosedError, EnvironmentUnavailable, HermesEnvError, UsageError
from .channel import ChannelCommand, ChannelNotStarted, ChannelPool, ChannelStream
from .handles import ProcessHandle, run_to_end
from .options import EnvironmentConfig
from .inputhints import wanted_input
from .output import CapturedOutput, FrameSplitter, OutputCapture
from .result import EXIT_CANCELLED, EXIT_CWD, EXIT_TIMEOUT, EndReason, ExecResult, Usage
from .session import Frame, SessionState, ShellSession, StateParseError, WrappedCommand, check_command

if TYPE_CHECKING:
    from .snapshot import FilesRef, Snapshot

__all__ = ["BaseEnvironment", "CancelToken", "StdinMode"]

StdinMode = Literal["pipe", "heredoc", "payload"]


class CancelToken(threading.Event):
    """A ``threading.Event`` named for what it is used for here."""


_log = logging.getLogger(__name__)
_HELPER_STUB = '__hermes_c=$(</dev/stdin); builtin eval "$__hermes_c"'

_POLL_S = 0.02  # how often a quiet command is checked for cancel and exit
_DRAIN_S = 0.2  # how long to keep reading after bash has exited
_MAX_READ = 1 << 20


class _Run:
    """Result of driving one wrapped script to its end."""

    __slots__ = ("captured", "frame", "exit_code", "timed_out", "interrupted", "corrupt", "notes", "usage", "signal")

    def __init__(self) -> None:
        self.captured: CapturedOutput | None = None
        self.frame: tuple[int, str, str | None] | None = None
        self.exit_code = 0
        self.timed_out = False
        self.interrupted = False
        self.corrupt = False
        self.notes: tuple[str, ...] = ()
        self.usage: Usage | None = None  # what the handle measured
        self.signal: int | None = None  # the signal that ended bash itself


class BaseEnvironment(abc.ABC):
    """One long-lived shell, as seen by the agent, over any backend.

    Thread-safe: ``execute()`` may be called from several threads at once.
    """

    #: registry name, set by the backend class
    name: ClassVar[str] = "base"
    #: how stdin reaches the command: a stream (pipe), embedded in the script
    #: (heredoc), or handed to the backend as a separate argument (payload)
    stdin_mode: ClassVar[StdinMode] = "pipe"
    #: whether the wrapper should record its pid for ``_kill_tree``
    records_pid: ClassVar[bool] = False
    #: paths in the target are paths on this machine (the session may then
    #: read its state file directly instead of through the output stream)
    shares_host_filesystem: ClassVar[bool] = False
    config_model: ClassVar[type[EnvironmentConfig]] = EnvironmentConfig
    #: the target's bash may print before a command's script runs (an rc file
    #: sourced under sshd); the channel then drops what comes first
    channel_startup_noise: ClassVar[bool] = False
    #: the backend can keep a named session whose server outlives this process (``environment.named``)
    named_sessions: ClassVar[bool] = False
    _named: Any = None  # the named session this environment is attached to (named.NamedBinding)

    def __init__(self, config: EnvironmentConfig | None = None, **options: Any) -> None:
        if config is None:
            config = self.config_model(**options)
        elif options:
            config = config.model_copy(update=options)
        self.config = config
        self.task_id = config.task_id or os.urandom(4).hex()
        self._session: ShellSession | None = None
        self._init_lock = threading.Lock()
        self._login_each = False
        self._closed = False
        self._notes: list[str] = []
        self._notes_lock = threading.Lock()
        # Commands in flight: close() stops them and waits until they are gone.
        self._running = 0
        self._running_cv = threading.Condition()
        self._closing = threading.Event()
        # Background-process registries following processes in this environment
        # (hermes_env_core.processes adds itself here).
        self._process_registries: weakref.WeakSet[Any] = weakref.WeakSet()
        self._channels: ChannelPool | None = None
        self._channel_lock = threading.Lock()
        self._runner: Any = None  # the session server's runner (serverexec.ServerRunner)

    # -- what a backend implements ------------------------------------------
    @abc.abstractmethod
    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        """Start ``bash -c script`` (``bash -l`` when ``login``) in the target.

        stdout and stderr must arrive merged on ``handle.stdout``. ``stdin_data``
        is None unless ``stdin_mode`` is ``pipe`` or ``payload``. ``timeout`` is
        advisory (the base class enforces it); raise ``EnvironmentUnavailable``
        when the target cannot run anything.
        """

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Release the backend's resources. Called once by ``close()``."""

    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        """Optional: start ``argv`` (a bash) in the target, its stdin and stdout
        one long-lived byte stream (see ``channel.ChannelStream``). A backend
        that offers it gets the resident shell channel; raise
        ``EnvironmentUnavailable`` when the target cannot be reached."""
        raise NotImplementedError

    def _channel_command_exited(self, handle: ChannelCommand, code: int) -> None:
        """Hook: a command that ran through a channel exited with ``code`` (may
        add notes, or raise ``BackendError`` when the target died under it)."""

    def _channel_orphaned(self, server_pid: int) -> None:
        """Hook: a lost channel's server (pid in the target) may still run with
        its command, e.g. when only the connection dropped; stop it if you can."""

    def _before_execute(self) -> None:
        """Hook run before each command (remote backends sync files here)."""

    def _state_dir(self) -> str:
        """A directory in the target where the session keeps small files.

        It must be private: owned by the session's user, mode 0700, with a name
        no other user can guess (``state_dir_private``). A backend that returns
        a shared directory (the default, ``/tmp``) gets a private one made
        inside it by the core.
        """
        return "/tmp"

    #: ``_state_dir()`` is already private (0700, unguessable); else the core makes one inside it
    state_dir_private: ClassVar[bool] = False

    def _put_private_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` in the target, readable only by the session's user.

        Only for backends that cannot feed bash's stdin (``stdin_mode =
        "heredoc"``): the wrapper script, which holds the session state and the
        frame nonce, then travels through this file instead of a command line.
        ``path`` is in the private state directory; bash empties it before the
        command runs. Not overridden: the script goes on the command line.
        """
        raise NotImplementedError

    def _kill_tree(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        """Stop the command's whole process tree; the default signals the handle."""
        if graceful and hasattr(handle, "terminate"):
            handle.terminate()
        else:
            handle.kill()

    def _tree_alive(self, handle: ProcessHandle, wrapped: WrappedCommand) -> bool | None:
        """Whether anything of a stopped command still runs (None: cannot tell).

        Asked after bash itself exited on SIGTERM, while SIGKILL is pending:
        True waits out the grace before SIGKILL, False skips SIGKILL, None
        sends it at once.
        """
        return None

    def _command_begin(self) -> None:
        """Hook: a command is about to go to the session server (reset per-command counters)."""

    def _command_usage(self, exit_code: int | None, started: float) -> Usage | None:
        """Hook: what the target measured of the command that just ended (peak memory, OOM kills);
        ``started`` is its wall-clock start. May add a note with ``_note``."""
        return None

    def _control_first(self) -> bool:
        """Hook: open the second (kill) stream with the server, not when first needed (a target
        whose process count is capped: a command may leave no room to start one later)."""
        return False

    def _explain_lost_since(self, started_monotonic: float) -> tuple[int, str] | None:
        return self._explain_lost(time.time() - (time.monotonic() - started_monotonic))

    def _explain_lost(self, started: float) -> tuple[int, str] | None:
        """Hook: the session server died during a command that started at ``started`` (wall clock).
        (exit code, why) when the target can tell (the OOM killer: 137), else None (an infrastructure error)."""
        return None

    def _has_live_processes(self) -> bool:
        """True while background processes started in this environment run."""
        return any(r.has_live(self) for r in list(self._process_registries))

    # -- helpers a backend may call ------------------------------------------
    def _note(self, text: str) -> None:
        """Attach a note to the next result of this environment (e.g. 'environment
        recreated'). A fact about one command belongs in its handle's ``notes``."""
        with self._notes_lock:
            self._notes.append(text)

    @property
    def session(self) -> ShellSession:
        if self._uses_server():
            current: ShellSession = self._server_runner().current_session()
            return current
        self._ensure_session()
        assert self._session is not None
        return self._session

    # -- the session server ------------------------------------------------------
    @property
    def session_mode(self) -> str:
        """``server`` (the session lives in a server in the target) or ``process`` (one bash per command)."""
        return "server" if self._uses_server() else "process"

    #: run the session server over ``open_channel`` (False: the resident channel of API 1.x, one
    #: bash per command restoring the state; for a backend not yet moved onto the server)
    session_server: ClassVar[bool] = True

    def _uses_server(self) -> bool:
        """Commands go through a session server in the target (a stream to one is offered and not turned off)."""
        return self.session_server and bool(self.config.channel) and self.offers_channel

    def _server_login(self) -> bool:
        """Whether the server starts as a login shell (its profile applies)."""
        return True

    def _server_runner(self) -> Any:
        from .serverexec import ServerRunner, private_dir_in

        runner = self._runner
        if runner is None:
            with self._init_lock:
                if self._closed:
                    raise EnvironmentClosedError(f"{self.name} environment {self.task_id!r} is closed")
                if self._runner is None and self._named is not None:
                    self._runner = self._named.make_runner(self)
                elif self._runner is None:
                    parent = self._state_dir()
                    self._runner = ServerRunner(
                        label=self.name,
                        opener=self._open_channel,
                        private_dir=parent if self.state_dir_private else private_dir_in(parent),
                        login=self._server_login(),
                        init=self._preamble(),
                        default_cwd=self.config.cwd,
                        excluded_prefixes=self.config.session_exclude_prefixes,
                        env_id=self.task_id,
                        note=self._note,
                        explain_lost=self._explain_lost_since,
                        control_first=self._control_first(),
                    )
                runner = self._runner
        return runner

    def _execute_on_server(
        self,
        command: str,
        *,
        cwd: str | None,
        timeout: float | None,
        stdin: str | bytes | None,
        cancel: threading.Event | None,
        on_output: Callable[[str], None] | None,
    ) -> ExecResult:
        runner = self._server_runner()
        self._before_execute()
        started = time.monotonic()
        data = stdin.encode("utf-8") if isinstance(stdin, str) else stdin
        capture = OutputCapture(self.config.max_output_bytes, spill_dir=self.config.spill_dir, on_output=on_output)
        eff_timeout = self.config.timeout if timeout is None else timeout
        with self._running_cv:
            if self._closed:
                raise EnvironmentClosedError(f"{self.name} environment {self.task_id!r} is closed")
            self._running += 1
        try:
            self._command_begin()
            wall = time.time()
            run = runner.run(
                command, cwd=cwd, stdin=data, timeout=eff_timeout, cancel=cancel, closing=self._closing,
                capture=capture, kill_grace_s=self.config.kill_grace_s,
            )
            measured = self._command_usage(run.report.exit_code if run.report else None, wall)
        finally:
            with self._running_cv:
                self._running -= 1
                self._running_cv.notify_all()
        notes = self._take_notes() + list(run.notes)
        cap = capture.finish()
        session = runner.session
        if run.report is not None:
            exit_code = run.report.exit_code
        elif run.timed_out:
            exit_code = EXIT_TIMEOUT
            notes.append(f"command timed out after {eff_timeout:g}s")
        else:
            exit_code = EXIT_CANCELLED
            if self._closing.is_set():
                notes.append("command stopped: the environment was closed")
        if data is None and exit_code != 0 and (sign := wanted_input(cap.text)) is not None:
            notes.append(
                f"the command wanted input ({sign!r}) but had none: it runs with stdin at end of input and no "
                "terminal; pass stdin, or use the tool's non-interactive option (such as -y)"
            )
        usage = Usage(cpu_user_s=run.cpu[0], cpu_system_s=run.cpu[1]) if run.cpu else Usage()
        if measured is not None:
            usage = measured.merged(usage)
        if run.notes_dir_recreated:
            notes.append("the session's private state directory had been removed; it was recreated")
        probe = _Run()
        probe.timed_out, probe.interrupted = run.timed_out, run.interrupted
        reason, sig = _end_reason(probe, exit_code, usage)
        return ExecResult(
            output=cap.text,
            exit_code=exit_code,
            timed_out=run.timed_out,
            interrupted=run.interrupted,
            truncated=cap.truncated,
            cwd=run.report.cwd if run.report is not None and cwd is None else (session.cwd if cwd is None else cwd),
            duration_s=time.monotonic() - (run.started or started),
            output_path=cap.spill_path,
            dropped_bytes=cap.dropped_bytes,
            notes=tuple(notes),
            usage=usage,
            end_reason=reason,
            signal=sig,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def offers_channel(self) -> bool:
        """Whether this backend can keep a resident shell channel open."""
        return type(self)._open_channel is not BaseEnvironment._open_channel

    @property
    def channel_mode(self) -> str:
        """How commands reach the target: ``channel`` or ``process`` (with why)."""
        if not self.offers_channel:
            return "process (the backend offers no channel)"
        if not self.config.channel:
            return "process (channel turned off by configuration)"
        pool = self._channels
        if pool is not None and pool.refused:
            return f"process (the channel was refused: {pool.refused})"
        return "channel"

    # -- public API ------------------------------------------------------------
    def execute(
        self,
        command: str,
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        cancel: threading.Event | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> ExecResult:
        """Run ``command`` as if typed into one long-lived bash."""
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0 (None for the configured default), got {timeout!r}")
        if self._closed:
            raise EnvironmentClosedError(f"{self.name} environment {self.task_id!r} is closed")
        check_command(command)
        if self._uses_server():
            return self._execute_on_server(command, cwd=cwd, timeout=timeout, stdin=stdin, cancel=cancel, on_output=on_output)
        session = self.session
        self._before_execute()
        started = time.monotonic()  # the command's own time, not setup or sync
        data = stdin.encode("utf-8") if isinstance(stdin, str) else stdin
        wrapped = session.wrap(
            command, cwd=cwd, stdin=data, record_pid=self.records_pid, channel=self._channel(),
            preamble=self._preamble(), login=self._login_each,
        )
        limit = self.config.max_output_bytes
        capture = OutputCapture(limit, spill_dir=self.config.spill_dir, on_output=on_output)
        eff_timeout = self.config.timeout if timeout is None else timeout
        with self._running_cv:
            if self._closed:
                session.release(wrapped)
                raise EnvironmentClosedError(f"{self.name} environment {self.task_id!r} is closed")
            self._running += 1
        try:
            run = self._drive(
                wrapped,
                capture,
                login=self._login_each,
                timeout=eff_timeout,
                cancel=cancel,
            )
        finally:
            session.release(wrapped)
            with self._running_cv:
                self._running -= 1
                self._running_cv.notify_all()
        notes = self._take_notes() + list(run.notes)
        exit_code = run.exit_code
        shell_cpu: Usage | None = None  # what the command's own bash counted, where the handle cannot tell
        if run.frame is not None and not run.corrupt:
            try:
                state = session.accept(wrapped, _frame(run.frame))
            except StateParseError as exc:
                notes.append(f"session state not saved: {exc}")
            else:
                if state is not None:
                    notes += self._leftover_notes(state, session.baseline)
                    if state.cpu_times is not None:
                        shell_cpu = Usage(cpu_user_s=state.cpu_times[0], cpu_system_s=state.cpu_times[1])
        elif run.corrupt:
            notes.append("session state not saved: its record was interleaved with background output")
        elif not run.timed_out and not run.interrupted:
            notes.append(
                "session state not saved: the shell ended before it could report "
                f"(exit {exit_code}); the next command starts from the state before this one"
            )
        if exit_code == EXIT_CWD and run.frame is not None and run.frame[1] == "" and not wrapped.explicit_cwd:
            reset = session.reset_cwd()
            notes.append(f"working directory {wrapped.cwd} is gone; session directory reset to {reset}")
        if run.timed_out:
            notes.append(f"command timed out after {eff_timeout:g}s")
        if run.interrupted and self._closing.is_set():
            notes.append("command stopped: the environment was closed")
        cap = run.captured
        assert cap is not None
        if data is None and exit_code != 0 and (sign := wanted_input(cap.text)) is not None:
            notes.append(
                f"the command wanted input ({sign!r}) but had none: it runs with stdin at end of input and no "
                "terminal; pass stdin, or use the tool's non-interactive option (such as -y)"
            )
        usage = (run.usage or Usage()).merged(shell_cpu)
        reason, sig = _end_reason(run, exit_code, usage)
        return ExecResult(
            output=cap.text,
            exit_code=exit_code,
            timed_out=run.timed_out,
            interrupted=run.interrupted,
            truncated=cap.truncated,
            cwd=(run.frame[1] or session.cwd) if run.frame else session.cwd,
            duration_s=time.monotonic() - started,
            output_path=cap.spill_path,
            dropped_bytes=cap.dropped_bytes,
            notes=tuple(notes),
            usage=usage,
            end_reason=reason,
            signal=sig,
        )

    def snapshot(
        self, name: str | None = None, *, paths: Sequence[str] | None = None, files: bool = True,
        max_bytes: int | None = None,
    ) -> Any:
        """Capture the session state and the target's files as a stored ``Snapshot``
        (see ``environment.snapshot``); ``create_environment(backend, snapshot=...)`` starts from it.
        ``paths``: the directories to archive (local, ssh; default the working directory);
        ``files=False``: the state alone, on any backend."""
        from .snapshot_files import DEFAULT_MAX_BYTES, take_snapshot

        return take_snapshot(self, name, paths=paths, files=files, max_bytes=max_bytes or DEFAULT_MAX_BYTES)

    def fork(self, n: int, *, paths: Sequence[str] | None = None) -> list[Any]:
        """``n`` independent environments, each with its own target, starting from this session's
        state and files (docker: n containers from one commit)."""
        from .snapshot_files import fork_environment

        return fork_environment(self, n, paths=paths)

    # -- snapshot files: a backend's own capture (optional hooks) ------------------
    def snapshot_files(
        self, workdir: Path, name: str, *, paths: Sequence[str] | None, temporary: bool
    ) -> FilesRef | None:
        """Capture this target's files for snapshot ``name``: write the parts into ``workdir``
        (a private directory) and return a ``FilesRef`` whose ``kind`` is the backend's own
        (not ``archive``, ``image`` or ``none``) and whose ``parts`` name those files; the core
        stores their SHA-256 and refuses the whole snapshot when one differs. Return None to
        let the core archive the working directory or ``paths`` over ``_run_bash``; raise
        ``UnsupportedOperation`` (saying what works instead) when this target's files cannot be
        captured. ``temporary``: the snapshot only seeds a ``fork`` and is removed after it.
        Called between commands; the default (None) is the core's own choice per built-in backend.
        A backend that overrides it also implements ``start_from_snapshot``."""
        return None

    @classmethod
    def start_from_snapshot(
        cls, snapshot: Snapshot, options: dict[str, Any], create: Callable[..., BaseEnvironment]
    ) -> BaseEnvironment:
        """A new environment whose files are ``snapshot``'s (a ``Snapshot`` whose ``files.kind`` is
        the one ``snapshot_files`` returned, parts already checked): prepare them, then call
        ``create(**options)`` (options possibly changed) and return what it made. When the files
        now live elsewhere, ``create(moved_dirs={old: new}, ...)`` says so: the session's cwd,
        OLDPWD and directory stack follow them. The core then restores the session state into
        the environment, and closes it if that fails."""
        from ..errors import UnsupportedOperation

        raise UnsupportedOperation(f"backend {cls.name!r} cannot start from a {snapshot.files.kind!r} snapshot")

    def close(self) -> None:
        """Release the environment; later ``execute()`` calls raise.

        A command still running is stopped (SIGTERM, then SIGKILL after
        ``kill_grace_s``) and ``close()`` returns once it is gone. The user's
        EXIT trap, if any, runs first (once, as a long-lived bash runs it at exit).
        A named session ends here (its server, and its target); ``detach()`` leaves it running.
        """
        if not self._closed and self._named is not None:
            self._named.closing(self)
        if not self._closed and self._runner is None:
            self._run_exit_trap()
        with self._running_cv:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
            if self._channels is not None:
                self._channels.closed = True  # commands queued for a channel give up
            # Each running command sees the flag within one poll; it then takes
            # at most the grace and a reap to end.
            limit = time.monotonic() + self.config.kill_grace_s + 30.0
            while self._running and (left := limit - time.monotonic()) > 0:
                self._running_cv.wait(left)
            if self._running:
                _log.warning("%r: %d command(s) still running at close", self, self._running)
        try:
            # Background processes die with the environment, unless detached.
            for registry in list(self._process_registries):
                try:
                    registry.close_environment(self)
                except Exception:  # noqa: BLE001 - cleanup must still run
                    _log.exception("closing background processes of %r failed", self)
        finally:
            try:
                if self._runner is not None:
                    said = self._runner.close()
                    if said.strip():
                        _log.info("%s: the session said at close: %s", self.name, said[-2000:].decode(errors="replace"))
                if self._channels is not None:
                    self._channels.close()
            finally:
                self.cleanup()

    def detach(self) -> None:
        """Leave this named session running in its target and release this object; attach again by its name."""
        if self._named is None:
            raise UsageError(f"{self.name}: detach() is for named sessions (create_environment(..., session=NAME))")
        self._named.detach(self)

    def __enter__(self) -> BaseEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} task_id={self.task_id!r}{' closed' if self._closed else ''}>"

    # -- internals --------------------------------------------------------------
    def _channel(self) -> str:
        """How the private wrapper script reaches bash (see ``ShellSession.wrap``)."""
        if self.stdin_mode != "heredoc":
            return "stdin"
        if type(self)._put_private_file is not BaseEnvironment._put_private_file:
            return "file"
        return "inline"

    def _preamble(self) -> str:
        """Statements the wrapper runs first (a backend's configured exports, say)."""
        return ""

    def _run_exit_trap(self) -> None:
        """The user's EXIT trap runs once, when the environment closes."""
        session = self._session
        if session is None:
            return
        body = session.take_exit_trap()
        if body is None:
            return
        try:
            r = self.execute(body, timeout=min(self.config.timeout or 30.0, 30.0))
            if r.output:
                _log.info("%s: EXIT trap at close said: %s", self.name, r.output[-2000:])
        except Exception:  # noqa: BLE001 - closing must go on
            _log.exception("%s: the EXIT trap failed at close", self.name)

    @staticmethod
    def _leftover_notes(state: SessionState, baseline: SessionState | None) -> list[str]:
        """What a command left that no later command can see, and a recreated state directory."""
        notes = []
        if state.jobs:
            notes.append(
                f"{state.jobs} background job(s) left running: they keep running, but the next command's "
                "job table, $! and wait do not see them (each command is a new bash)"
            )
        base_fds = set(baseline.fds) if baseline else set()
        fds = [str(fd) for fd in state.fds if fd not in base_fds]
        if fds:
            notes.append(
                f"file descriptor(s) {', '.join(fds)} opened with exec are closed after this command "
                "(descriptors do not survive from one command to the next)"
            )
        if state.dir_recreated:
            notes.append("the session's private state directory had been removed; it was recreated")
        return notes

    def _take_notes(self) -> list[str]:
        with self._notes_lock:
            notes, self._notes = self._notes, []
        return notes

    def _ensure_session(self) -> None:
        if self._session is not None:
            return
        with self._init_lock:
            if self._session is not None:
                return
            state_dir = self._state_dir()
            if not self.state_dir_private:
                state_dir = self._make_private_dir(state_dir)
            session = ShellSession(
                state_dir=state_dir,
                default_cwd=self.config.cwd,
                excluded_prefixes=self.config.session_exclude_prefixes,
                env_id=self.task_id,
            )
            base = self._snapshot(session, login=False)
            if base is None or base[1] is None:
                raise EnvironmentUnavailable(
                    f"{self.name}: bash in the target did not report its state; is bash installed there?"
                )
            session.accept(base[0], base[1], as_baseline=True)
            login = self._snapshot(session, login=True)
            state = None
            if login is not None and login[1] is not None:
                try:
                    state = session.accept(login[0], login[1])
                except StateParseError:
                    state = None
            if login is not None and login[1] is None and login[2] != 0:
                # The profile itself fails (exits): a login shell per command
                # would fail the same way, so run without it and say so.
                self._note(f"login shell start-up failed (exit {login[2]}); running without ~/.profile")
                state = session.baseline
            elif state is None:
                # The login state could not be read back: let every command
                # run as a login shell so that the profile still applies.
                self._login_each = True
                state = session.baseline
            assert state is not None
            session.set_state(session.interactive_defaults(state))
            self._session = session

    def _make_private_dir(self, parent: str) -> str:
        """Create an unguessable 0700 directory of the session's user in ``parent`` of the target."""
        path = posixpath.join(parent, "hermes-env-" + secrets.token_hex(16))
        q = shlex.quote(path)
        script = (
            f"command mkdir -p -- {shlex.quote(parent)} 2>/dev/null; "
            f"(builtin umask 077; command mkdir -m 700 -- {q}) && [ -d {q} ] && [ -O {q} ] && [ ! -L {q} ] "
            "&& builtin printf private"
        )
        code, out = self._run_helper(script, timeout=60.0)
        # The exit status decides (some SDKs deliver a helper's output late, or not at all).
        if code != 0 or (out and not out.endswith(b"private")):
            raise EnvironmentUnavailable(
                f"{self.name}: cannot create a private state directory {path} in the target "
                f"(exit {code}): {out.decode(errors='replace').strip()[:300]}"
            )
        return path

    def _run_helper(self, script: str, *, timeout: float) -> tuple[int, bytes]:
        """Run a short script outside the session, to its end; (exit code, merged output)."""
        handle = self._run_bash(script, login=False, timeout=timeout, stdin_data=None)
        try:
            return run_to_end(handle, timeout=timeout)
        except TimeoutError as exc:
            raise EnvironmentUnavailable(f"{self.name}: a helper command did not finish in {timeout:g}s") from exc

    def run_outside(self, script: str, *, timeout: float = 60.0) -> tuple[int, bytes]:
        """Run a bash script in the target outside the session, to its end: (exit code, merged output).

        The session's state is neither restored nor saved (for the library's own work:
        background processes, checks). The script goes through stdin, never on a
        command line, wherever the backend can feed stdin; an idle resident channel
        is used when there is one. Past ``timeout`` it is killed and ``BackendError`` raised.
        """
        handle = self._start_helper(script, timeout=timeout)
        try:
            return run_to_end(handle, timeout=timeout)
        except TimeoutError as exc:
            raise BackendError(f"{self.name}: a helper script did not finish in {timeout:g}s") from exc
        except HermesEnvError:
            raise
        except Exception as exc:  # an SDK's error while waiting for the exit
            raise BackendError(f"{self.name}: a helper script did not exit: {exc!r}") from exc

    def before_command(self) -> None:
        """Do what precedes each command (remote backends push synced files); for
        processes started outside ``execute()``."""
        self._before_execute()

    @property
    def login_each(self) -> bool:
        """Whether every process of the session starts as a login shell (the ``login`` option)."""
        return self._login_each

    def _snapshot(self, session: ShellSession, *, login: bool) -> tuple[WrappedCommand, Any, int] | None:
        """Capture the state of a fresh (login) shell; (wrapped, frame or None, exit code)."""
        wrapped = session.wrap(
            ":", snapshot=True, record_pid=self.records_pid, channel=self._channel(), preamble=self._preamble()
        )
        capture = OutputCapture(self.config.max_output_bytes)
        try:
            run = self._drive(wrapped, capture, login=login, timeout=60.0, cancel=None)
        finally:
            session.release(wrapped)
        if run.frame is None or run.corrupt or run.exit_code != 0:
            return wrapped, None, run.exit_code or 1
        return wrapped, _frame(run.frame), 0

    def _drive(
        self,
        wrapped: WrappedCommand,
        capture: OutputCapture,
        *,
        login: bool,
        timeout: float | None,
        cancel: threading.Event | None,
    ) -> _Run:
        run = _Run()
        splitter = FrameSplitter(wrapped.marker, capture.feed)
        for attempt in (0, 1):
            handle = self._start_wrapped(wrapped, login=login, timeout=timeout)
            try:
                return self._drive_handle(handle, run, splitter, capture, wrapped, timeout=timeout, cancel=cancel)
            except ChannelNotStarted:
                if attempt:
                    raise
                # The channel was found dead as the command was sent: it never ran; send it again.
            finally:
                if isinstance(handle, ChannelCommand) and self._channels is not None:
                    self._channels.release(handle.channel, handle)
        raise AssertionError("unreachable")

    def _drive_handle(
        self,
        handle: ProcessHandle,
        run: _Run,
        splitter: FrameSplitter,
        capture: OutputCapture,
        wrapped: WrappedCommand,
        *,
        timeout: float | None,
        cancel: threading.Event | None,
    ) -> _Run:
        stdout = handle.stdout
        if stdout is None:
            raise BackendError(f"{self.name}: the process handle has no stdout")
        fd = stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        start = time.monotonic()
        deadline = start + timeout if timeout else None
        kill_at: float | None = None  # when SIGKILL follows SIGTERM
        exited_at: float | None = None
        reason: str | None = None
        read = os.read
        bufsize = 65536
        try:
            while True:
                now = time.monotonic()
                wait = _POLL_S
                if deadline is not None and reason is None:
                    wait = min(wait, max(deadline - now, 0.0))
                if splitter.done:
                    wait = 0.0
                try:
                    events = poller.poll(wait * 1000.0)
                except InterruptedError:
                    events = []
                if events:
                    try:
                        data = read(fd, bufsize)
                    except OSError as exc:
                        if exc.errno in (errno.EAGAIN, errno.EINTR):
                            continue
                        data = b""
                    if data:
                        splitter.feed(data)
                        if len(data) == bufsize and bufsize < _MAX_READ:
                            bufsize = _MAX_READ  # a big producer: fewer, larger reads
                        continue
                    break  # EOF: everyone holding the pipe is gone
                if splitter.done:
                    break  # bash reported and is exiting; background children may hold the pipe
                now = time.monotonic()
                if reason is None:
                    if (cancel is not None and cancel.is_set()) or self._closing.is_set():
                        reason = "cancel"
                    elif deadline is not None and now >= deadline:
                        reason = "timeout"
                    if reason is not None:
                        self._stop(handle, wrapped, graceful=True)
                        kill_at = now + self.config.kill_grace_s
                elif kill_at is not None and now >= kill_at:
                    self._stop(handle, wrapped, graceful=False)
                    kill_at = None
                if handle.poll() is not None:
                    # bash is gone but a pipe holder lingers: take what is there.
                    if exited_at is None:
                        exited_at = now
                    elif now - exited_at > _DRAIN_S:
                        break
            if reason is not None and kill_at is not None and not isinstance(handle, ChannelCommand):
                # bash ended on SIGTERM within the grace; what it started may not have.
                # (A channel's server sweeps a killed command's leftovers itself.)
                self._finish_kill(handle, wrapped, kill_at)
            splitter.flush()
            run.frame = splitter.frame
            run.corrupt = splitter.corrupt
            code = self._reap(handle, finished=splitter.done or reason is None)
            # Per-command facts a handle knows (OOM, recreated): on this result only.
            run.notes = tuple(getattr(handle, "notes", ()) or ())
            run.usage = getattr(handle, "usage", None)
            run.signal = -code if code < 0 else None
        except BaseException:
            # An on_output callback raised, or the caller was interrupted: the
            # command must not outlive the call.
            try:
                self._stop(handle, wrapped, graceful=False)
                self._reap(handle, finished=False)
            except Exception:  # noqa: BLE001 - the first exception is the one to report
                _log.exception("%r: stopping the command after an error failed", self)
            raise
        finally:
            try:
                stdout.close()
            except OSError:
                pass
        run.captured = capture.finish()
        if reason == "cancel":
            run.exit_code, run.interrupted = EXIT_CANCELLED, True
        elif reason == "timeout":
            run.exit_code, run.timed_out = EXIT_TIMEOUT, True
        elif run.frame is not None and not run.corrupt:
            run.exit_code = run.frame[0]
            # bash killed by a signal still runs its EXIT trap, which sees $? = 0;
            # the process status tells the truth then (shell convention 128+N).
            if code < 0:
                run.exit_code = 128 - code
            elif run.exit_code == 0 and code > 128:
                run.exit_code = code
        else:
            run.exit_code = 128 - code if code < 0 else code
        return run

    def _start_wrapped(self, wrapped: WrappedCommand, *, login: bool, timeout: float | None) -> ProcessHandle:
        """Start bash on a wrapped script, its private part through the backend's channel."""
        if wrapped.private_path is not None:
            self._put_private_file(wrapped.private_path, wrapped.payload)
            return self._start_bash(wrapped.script, login=login, timeout=timeout, stdin_data=None)
        return self._start_bash(
            wrapped.script, login=login, timeout=timeout, stdin_data=wrapped.payload if wrapped.payload else None
        )

    def _stop(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        if isinstance(handle, ChannelCommand):
            handle.terminate() if graceful else handle.kill()  # the server kills the tree
        else:
            self._kill_tree(handle, wrapped, graceful=graceful)

    def _channel_pool(self) -> ChannelPool | None:
        if self._channels is None:
            if not self.config.channel or not self.offers_channel:
                return None
            with self._channel_lock:
                if self._channels is None:
                    self._channels = ChannelPool(self._open_channel, limit=self.config.max_channels, label=self.name)
        return self._channels

    def _start_helper(self, script: str, *, timeout: float | None) -> ProcessHandle:
        """A helper script outside the session (background-process polls): through
        a channel that is idle right now, else a new process; never waits for one."""
        # The script may carry the session's state (a background process's start):
        # through stdin, never on a command line, wherever stdin can be fed.
        data: bytes | None = None
        if self._channel() == "stdin":
            script, data = _HELPER_STUB, script.encode("utf-8", "surrogateescape")
        pool = self._channel_pool()
        channel = pool.try_acquire() if pool is not None else None
        if channel is not None:
            try:
                return channel.start(script, login=False, stdin_data=data, strip_startup=self.channel_startup_noise)
            except EnvironmentUnavailable:
                pass
        return self._run_bash(script, login=False, timeout=timeout, stdin_data=data)

    def _start_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        """Through a free resident channel when there is one, else a new process."""
        pool = self._channel_pool()
        if pool is not None:
            for why in pool.take_lost():
                self._note(f"resident shell channel lost ({why}); a new one is opened")
            for pid in pool.take_lost_pids():
                self._channel_orphaned(pid)
            refused = pool.refused
            try:
                channel = pool.acquire()
            except EnvironmentUnavailable as exc:
                # Let the process path bring the target back (and say so).
                _log.debug("%s: opening a channel failed: %s", self.name, exc)
                channel = None
            if channel is not None:
                try:
                    cmd = channel.start(
                        script, login=login, stdin_data=stdin_data, strip_startup=self.channel_startup_noise
                    )
                    cmd.on_exit = self._channel_command_exited
                    return cmd
                except EnvironmentUnavailable:
                    pass  # it died just now: run as a process
            elif pool.refused and refused is None:
                self._note(f"resident shell channel not available ({pool.refused}); one process per command")
        return self._run_bash(script, login=login, timeout=timeout, stdin_data=stdin_data)

    def _finish_kill(self, handle: ProcessHandle, wrapped: WrappedCommand, kill_at: float) -> None:
        """Send the pending SIGKILL: at once when the backend cannot tell what is
        left, at the end of the grace while something is, never once all is gone."""
        alive = self._tree_alive(handle, wrapped)
        while alive and (left := kill_at - time.monotonic()) > 0:
            time.sleep(min(left, _POLL_S))
            alive = self._tree_alive(handle, wrapped)
        if alive is not False:
            self._kill_tree(handle, wrapped, graceful=False)

    def _reap(self, handle: ProcessHandle, *, finished: bool) -> int:
        # bash is known to be exiting: a plain wait() blocks in waitpid,
        # where Popen.wait(timeout) would poll with sleeps.
        if finished and isinstance(handle, subprocess.Popen):
            return handle.wait()
        try:
            return handle.wait(timeout=10.0)
        except BackendError:
            raise
        except TimeoutError:
            handle.kill()
            try:
                return handle.wait(timeout=5.0)
            except TimeoutError as exc:
                raise BackendError(f"{self.name}: command did not exit after being killed") from exc
        except Exception as exc:  # subprocess.TimeoutExpired and SDK errors
            if type(exc).__name__ == "TimeoutExpired":
                handle.kill()
                return handle.wait(timeout=5.0)
            raise BackendError(f"{self.name}: lost the command: {exc!r}") from exc


def _end_reason(run: _Run, exit_code: int, usage: Usage) -> tuple[EndReason, int | None]:
    if run.timed_out:
        return EndReason.TIMED_OUT, None
    if run.interrupted:
        return EndReason.CANCELLED, None
    if usage.oom_killed:
        return EndReason.OOM_KILLED, 9
    if run.signal is not None:
        return EndReason.SIGNALED, run.signal
    if 128 < exit_code <= 128 + 64:
        return EndReason.SIGNALED, exit_code - 128
    return EndReason.EXITED, None


def _frame(raw: tuple[int, str, str | None]) -> Frame:
    return Frame(exit_code=raw[0], cwd=raw[1], state_text=raw[2])
