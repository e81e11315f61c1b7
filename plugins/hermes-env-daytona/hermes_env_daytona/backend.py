"""The Daytona backend: every command is a fresh bash run by the SDK's
``process.exec`` in one sandbox per task id, created or resumed by name.

The daytona SDK is imported when an environment is created, never before.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import secrets
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.environment.handles import ProcessHandle, ThreadedProcessHandle, Writer
from hermes_env_core.environment.result import ExecResult
from hermes_env_core.environment.session import WrappedCommand, kill_tree_script
from hermes_env_core.errors import BackendError, EnvironmentClosedError, EnvironmentUnavailable, HermesEnvError

from . import _sdk
from ._commands import (
    ARG_LIMIT,
    bash_line,
    exports,
    file_script,
    file_session_line,
    nonce_of,
    session_line,
    stub_session_line,
    trailer_line,
)
from ._session import CommandFollower, SessionPool, StartedCommand, no_bash
from .config import DaytonaConfig, memory_gib

if TYPE_CHECKING:
    from hermes_env_core.sync import PullResult, PushResult, SyncEngine

__all__ = ["DaytonaEnvironment"]

log = logging.getLogger(__name__)

_AUX_TIMEOUT_S = 30  # kill, pid and output-polling commands
#: The core exports a backend's configured env itself (``_preamble``) when it has that hook.
_CORE_PREAMBLE = hasattr(BaseEnvironment, "_preamble")
_TASK_LABEL = "hermes-env-task"
_NAME_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class _Handle(ThreadedProcessHandle):
    """Raises our own (already explained) errors as they are, others as the base does."""

    notes: list[str]
    forced: threading.Event

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise TimeoutError("command still running")
        if isinstance(self.error, EnvironmentUnavailable) and not self.killed:
            raise self.error
        return super().wait(0)


class DaytonaEnvironment(BaseEnvironment):
    """Runs commands in a Daytona sandbox named after the task id.

    An existing sandbox of that name is resumed (started when stopped or
    archived), otherwise one is created on first use; one found stopped
    between commands is started again. ``cleanup()`` stops it when
    ``persistent`` (the default), else deletes it.
    """

    name = "daytona"
    #: a detached background process outlives close() only in a sandbox that is kept (stopped, not deleted)
    background_options: ClassVar[dict[str, Any]] = {"persistent": True}
    stdin_mode = "heredoc"
    records_pid = True
    config_model = DaytonaConfig

    def __init__(self, config: DaytonaConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        cfg: DaytonaConfig = self.config  # type: ignore[assignment]
        self._cfg = cfg
        self._sdk = _sdk.sdk()
        self._api_url = cfg.api_url or os.environ.get("DAYTONA_API_URL") or "https://app.daytona.io/api"
        self._client = self._make_client()
        self.sandbox_name = cfg.sandbox_name or _safe_name(f"hermes-{self.task_id}")
        self._sandbox: Any = None
        self._ready_lock = threading.Lock()
        self._home: str | None = None
        self._home_of: str | None = None
        self._live = threading.local()
        self._sessions = SessionPool(_safe_name(f"hermes-{self.task_id}"))
        self._pool: ThreadPoolExecutor | None = None
        self._pids: dict[str, int] = {}
        self._resources = self._capped_resources()
        self._sync: SyncEngine | None = None
        self._push_lock = threading.Lock()
        self._sync_lost = False
        self._state_lost = False  # a new sandbox: the session's private directory is elsewhere
        if cfg.sync:
            from hermes_env_core.sync import SyncEngine, SyncMapping

            from .transport import DaytonaSyncTransport

            mappings = [
                SyncMapping(host=m.host, remote=m.remote, include=m.include, exclude=m.exclude, upload_only=m.upload_only)
                for m in cfg.sync
            ]
            self._sync = SyncEngine(DaytonaSyncTransport(self), mappings, interval=cfg.sync_interval_s)

    # -- requirements and the client -----------------------------------------------
    @classmethod
    def check_requirements(cls) -> list[str]:
        """What is missing to create a Daytona environment here (no network calls)."""
        problems: list[str] = []
        try:
            version = importlib.metadata.version("daytona")
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"the daytona SDK is not installed: pip install '{_sdk.SDK_REQUIREMENT}'")
        else:
            if not version.startswith("0.226."):
                problems.append(f"daytona {version} is installed; this backend is tested with {_sdk.SDK_REQUIREMENT}")
        env = os.environ
        if not (
            env.get("DAYTONA_API_KEY")
            or env.get("TERMINAL_API_KEY")
            or (env.get("DAYTONA_JWT_TOKEN") and env.get("DAYTONA_ORGANIZATION_ID"))
        ):
            problems.append(
                "no Daytona credentials: set DAYTONA_API_KEY (or api_key in [terminal.daytona] of the config file)"
            )
        return problems

    def _make_client(self) -> Any:
        cfg, sdk = self._cfg, self._sdk
        key = cfg.api_key.get_secret_value() if cfg.api_key is not None else None
        try:
            # api_url is always passed: the SDK's fallback to its deprecated server_url warns.
            return sdk.Daytona(sdk.DaytonaConfig(api_key=key, api_url=self._api_url, target=cfg.target))
        except sdk.DaytonaAuthenticationError as exc:
            raise EnvironmentUnavailable(
                "daytona: no credentials: set DAYTONA_API_KEY (or DAYTONA_JWT_TOKEN and DAYTONA_ORGANIZATION_ID), "
                "or pass api_key (TERMINAL_API_KEY, or api_key in [terminal.daytona])"
            ) from exc
        except sdk.DaytonaError as exc:
            raise self._error(exc, "creating the Daytona client") from exc

    def _error(self, exc: BaseException, what: str, cls: type[EnvironmentUnavailable] = EnvironmentUnavailable):
        return _sdk.to_unavailable(exc, what, api_url=self._api_url, cls=cls)

    def _capped_resources(self) -> tuple[int | None, int | None, int | None]:
        cfg = self._cfg
        out = []
        for what, value, cap, unit in (
            ("cpu", cfg.cpu, cfg.max_cpu, ""),
            ("memory", memory_gib(cfg.memory) if cfg.memory is not None else None, cfg.max_memory, " GiB"),
            ("disk", cfg.disk, cfg.max_disk, " GiB"),
        ):
            if value is not None and value > cap:
                self._note(f"{what} {value}{unit} is over the per-sandbox limit; using {cap}{unit} (max_{what})")
                value = cap
            out.append(value)
        return out[0], out[1], out[2]

    # -- the sandbox ----------------------------------------------------------------
    @property
    def sandbox(self) -> Any:
        """The SDK's ``Sandbox``, created or resumed on first use."""
        return self._ready()

    def _ready(self) -> Any:
        sb = self._sandbox
        # Sandbox.state follows the SDK's pushed state events, so this costs no request.
        if sb is not None and _sdk.state_of(sb) == "started":
            return sb
        with self._ready_lock:
            if self.closed:
                raise EnvironmentClosedError(f"daytona environment {self.task_id!r} is closed")
            sb = self._sandbox
            if sb is not None:
                sb = self._refresh(sb)
            if sb is None:
                sb = self._acquire()
            else:
                sb = self._bring_up(sb, resumed=False)
            self._sandbox = sb
            return sb

    def _lifecycle(self, what: str, fn):  # type: ignore[no-untyped-def]
        try:
            return _sdk.call_with_rate_limit(fn)
        except self._sdk.DaytonaError as exc:
            raise self._error(exc, what) from exc

    def _refresh(self, sb: Any) -> Any:
        """``sb`` with a fresh state, or None when it no longer exists."""
        try:
            _sdk.call_with_rate_limit(sb.refresh_data)
        except self._sdk.DaytonaNotFoundError:
            self._note(f"sandbox {self.sandbox_name} was deleted; created a new one (session state restored)")
            self._lost_files()
            return None
        except self._sdk.DaytonaError as exc:
            raise self._error(exc, f"reading the state of sandbox {self.sandbox_name}") from exc
        return sb

    def _acquire(self) -> Any:
        """The sandbox of this name: resumed if it exists, else created."""
        try:
            sb = _sdk.call_with_rate_limit(lambda: self._client.get(self.sandbox_name))
        except self._sdk.DaytonaNotFoundError:
            sb = None
        except self._sdk.DaytonaError as exc:
            raise self._error(exc, f"looking up sandbox {self.sandbox_name}") from exc
        if sb is not None and _sdk.state_of(sb) not in _sdk.GONE:
            sb = self._bring_up(sb, resumed=True)
            self._apply_auto_stop(sb)
            return sb
        return self._create()

    def _create(self) -> Any:
        cfg, sdk = self._cfg, self._sdk
        labels = {**cfg.labels, _TASK_LABEL: _safe_name(self.task_id)}
        common: dict[str, Any] = {"name": self.sandbox_name, "labels": labels}
        if cfg.auto_stop_interval is not None:
            common["auto_stop_interval"] = cfg.auto_stop_interval
        if cfg.image:
            cpu, memory, disk = self._resources
            resources = None
            if any(v is not None for v in (cpu, memory, disk)):
                resources = sdk.Resources(cpu=cpu, memory=memory, disk=disk)
            params = sdk.CreateSandboxFromImageParams(image=cfg.image, resources=resources, **common)
        else:
            params = sdk.CreateSandboxFromSnapshotParams(snapshot=cfg.snapshot, **common)
        what = f"creating sandbox {self.sandbox_name}"
        try:
            return _sdk.call_with_rate_limit(lambda: self._client.create(params, timeout=cfg.create_timeout))
        except sdk.DaytonaConflictError:
            # Created by someone else meanwhile (another process with this task id): use it.
            sb = self._lifecycle(f"looking up sandbox {self.sandbox_name}", lambda: self._client.get(self.sandbox_name))
            return self._bring_up(sb, resumed=True)
        except sdk.DaytonaError as exc:
            if getattr(exc, "status_code", None) is None:
                self._raise_if_broken(what)
            raise self._error(exc, what) from exc

    def _raise_if_broken(self, what: str) -> None:
        """After a failed create: if the sandbox exists in an error state, say so."""
        try:
            sb = self._client.get(self.sandbox_name)
        except Exception:  # noqa: BLE001 - the original error is the one to report
            return
        if _sdk.state_of(sb) in _sdk.BROKEN:
            raise self._broken(sb, what)

    def _broken(self, sb: Any, what: str) -> EnvironmentUnavailable:
        reason = getattr(sb, "error_reason", None) or "no reason given"
        return EnvironmentUnavailable(
            f"daytona: {what}: sandbox {self.sandbox_name} ({sb.id}) is in state {_sdk.state_of(sb)}: {reason}; "
            "delete it (in the Daytona dashboard or with the SDK) or use another task id or sandbox_name"
        )

    def _bring_up(self, sb: Any, *, resumed: bool) -> Any:
        """Wait for, start or recover ``sb`` until it runs; a new sandbox if it is gone.

        A sandbox on its way down (``stopping``, ``archiving``, ``pausing``:
        auto-stop, auto-archive, the dashboard) is waited for until it settles,
        then started: the API refuses a start meanwhile (409), and the SDK's
        ``wait_for_sandbox_stop`` would wait for ``stopped`` where an archiving
        sandbox ends ``archived``. A start refused because the state moved on
        (auto-archive began) waits and starts again, within ``start_timeout``.
        """
        timeout = self._cfg.start_timeout
        deadline = time.monotonic() + timeout
        what = f"{'resuming' if resumed else 'starting'} sandbox {self.sandbox_name}"
        first = _sdk.state_of(sb)
        if first == "started":
            if resumed:
                self._note(f"resumed running sandbox {self.sandbox_name}")
            return sb
        for _attempt in range(4):
            state = _sdk.state_of(sb)
            if state in _sdk.GOING_DOWN:
                if not self._settle(sb, what, deadline):
                    self._note(f"sandbox {self.sandbox_name} was deleted; created a new one (session state restored)")
                    self._lost_files()
                    return self._create()
                state = _sdk.state_of(sb)
            left = max(deadline - time.monotonic(), 1.0)
            if state == "started":
                break
            if state in _sdk.RESUMABLE:
                try:
                    _sdk.call_with_rate_limit(lambda: sb.start(timeout=left))
                except self._sdk.DaytonaConflictError:
                    self._lifecycle(what, sb.refresh_data)  # it moved on meanwhile: look again
                    continue
                except self._sdk.DaytonaError as exc:
                    raise self._error(exc, what) from exc
                self._note(f"{'resumed' if resumed else 'restarted'} {state} sandbox {self.sandbox_name}")
            elif state in _sdk.COMING_UP:
                self._lifecycle(what, lambda: sb.wait_for_sandbox_start(timeout=left))
            elif state in _sdk.BROKEN:
                if not getattr(sb, "recoverable", False):
                    raise self._broken(sb, what)
                self._lifecycle(f"recovering sandbox {self.sandbox_name}", lambda: sb.recover(timeout=left))
                self._note(f"recovered sandbox {self.sandbox_name} from state {state}")
            elif state in _sdk.GONE:
                return self._create()
            else:
                raise EnvironmentUnavailable(
                    f"daytona: {what}: sandbox {self.sandbox_name} is in unknown state {state!r}"
                )
            if _sdk.state_of(sb) == "started":
                break
        if _sdk.state_of(sb) != "started":
            raise EnvironmentUnavailable(
                f"daytona: {what}: sandbox {self.sandbox_name} is {_sdk.state_of(sb)}, not started"
            )
        return sb

    def _settle(self, sb: Any, what: str, deadline: float) -> bool:
        """Wait until ``sb`` has finished going down (stopped, archived, paused or broken); False if deleted."""
        delay = 0.1
        while _sdk.state_of(sb) in _sdk.GOING_DOWN:
            if time.monotonic() >= deadline:
                raise EnvironmentUnavailable(
                    f"daytona: {what}: sandbox {self.sandbox_name} was still {_sdk.state_of(sb)} after "
                    f"{self._cfg.start_timeout:g}s (start_timeout); try again later or raise start_timeout"
                )
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.01)))
            delay = min(delay * 1.5, 2.0)
            try:
                _sdk.call_with_rate_limit(sb.refresh_data)
            except self._sdk.DaytonaNotFoundError:
                return False
            except self._sdk.DaytonaError as exc:
                raise self._error(exc, what) from exc
        return True

    def _apply_auto_stop(self, sb: Any) -> None:
        want = self._cfg.auto_stop_interval
        if want is not None and getattr(sb, "auto_stop_interval", None) != want:
            self._lifecycle("setting the auto-stop interval", lambda: sb.set_autostop_interval(want))

    def _lost_files(self) -> None:
        # Called under the readiness lock: the engine is reset later, outside it,
        # since a push holding the engine may itself be waiting for that lock.
        self._home = None
        self._sync_lost = True
        self._state_lost = True

    def _state_dir(self) -> str:
        # The file API (private script uploads) reaches the user's home; the core
        # makes the private 0700 directory inside this one.
        return f"{self.home()}/.cache/hermes-env"

    def home(self) -> str:
        """The sandbox user's home directory (relative sync paths start there)."""
        sb = self._ready()
        if self._home is None or self._home_of != sb.id:
            self._home = self._lifecycle("asking for the home directory", sb.get_user_home_dir)
            self._home_of = sb.id
        assert self._home is not None
        return self._home

    # -- running commands ------------------------------------------------------------
    def _exec(self, command: str, *, timeout: int | None = _AUX_TIMEOUT_S, what: str = "running a command") -> Any:
        """``process.exec(command)`` in the sandbox, starting it again if it was stopped.

        A call that failed because the sandbox was not running (stopped,
        archived, deleted behind our back) is retried once after bringing it
        back; the command cannot have run. Errors are ``BackendError``.
        """
        sdk = self._sdk
        for attempt in (1, 2):
            sb = self._ready()
            try:
                res = sb.process.exec(command, env=self._cfg.env or None, timeout=timeout)
            except sdk.DaytonaTimeoutError as exc:
                status = getattr(exc, "status_code", None)
                if status == 408:
                    # REQUEST_TIMEOUT: the daemon killed the command at the time limit of the call.
                    raise BackendError(
                        f"daytona: {what}: the sandbox's daemon ended the command at its time limit "
                        f"({timeout}s, HTTP 408 REQUEST_TIMEOUT); its output and exit status are lost"
                    ) from exc
                if status == 504:
                    raise BackendError(
                        f"daytona: {what}: a gateway in front of the Daytona API cut the request (HTTP 504); "
                        "the command may have run, and its result is unknown"
                    ) from exc
                raise self._error(exc, what, BackendError) from exc
            except sdk.DaytonaError as exc:
                if attempt == 1 and self._revived_after(sb, exc):
                    continue
                raise self._error(exc, what, BackendError) from exc
            code = res.exit_code
            if code is None or int(code) < 0:
                # Go's ExitCode() is -1 for a process a signal ended (or that never started):
                # the daemon cannot say more, and a made-up status would be a lie.
                output = (res.result or "").strip()[-500:]
                raise BackendError(
                    f"daytona: {what}: the daemon reports exit code {code} (the shell was ended by a signal, "
                    f"or could not start); output: {output!r}"
                )
            return res
        raise AssertionError("unreachable")

    def _revived_after(self, sb: Any, exc: BaseException) -> bool:
        """Whether ``sb`` had stopped or vanished and is running again (so retrying is safe)."""
        if isinstance(exc, (self._sdk.DaytonaAuthenticationError, self._sdk.DaytonaRateLimitError)):
            return False
        if getattr(exc, "status_code", None) in (401, 403, 429):  # the file API's plain DaytonaError
            return False
        with self._ready_lock:
            if self._sandbox is not sb:
                return True  # another thread replaced it already
            fresh = self._refresh(sb)
            if fresh is not None and _sdk.state_of(fresh) == "started":
                return False  # it runs: the failure was something else
            self._sandbox = self._bring_up(fresh, resumed=False) if fresh is not None else self._acquire()
            return True

    def execute(self, command: str, **kwargs: Any) -> ExecResult:
        # Only a hint for _run_bash; the flow is the base class's. The SDK returns
        # output when a command ends, so a caller watching it live (on_output)
        # gets it from a file in the sandbox that is polled instead.
        self._live.on = kwargs.get("on_output") is not None
        try:
            return super().execute(command, **kwargs)
        finally:
            self._live.on = False

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        self._ready()  # raise here, not from the handle, when the sandbox cannot run
        remap = getattr(self._live, "remap", None)
        if remap is not None:
            self._live.remap = None
            script = script.replace(remap[0], remap[1])
        # The frame's nonce is in the script, or (private script in a file) in what
        # _put_private_file just wrote for this thread.
        private_nonce = getattr(self._live, "nonce", None)
        self._live.nonce = None
        nonce = private_nonce or nonce_of(script)
        end = None if nonce is None else f"\x1e{nonce}:E\n"
        token = secrets.token_hex(12)
        trailer = trailer_line(token)
        if private_nonce is not None:
            # The core's stub, its private script already in the session's 0700 directory.
            line = stub_session_line(script, login=login, token=token)
        else:
            # A script that may hold state or values: never an argument, always the here-document.
            if not _CORE_PREAMBLE:
                script = exports(self._cfg.env) + script
            line = session_line(script, login=login, token=token)
        if len(line.encode("utf-8", "surrogateescape")) > ARG_LIMIT:
            # A large script (a large session, a large stdin) goes up as a private file that
            # deletes itself as it starts, and the session command only names it.
            path = f"{self.home()}/.cache/hermes-env/run-{nonce or secrets.token_hex(12)}.sh"
            self._upload(file_script(script), path)
            line = file_session_line(path, login=login, token=token)
        live = bool(getattr(self._live, "on", False))
        stop = threading.Event()
        forced = threading.Event()  # SIGKILL sent: no end record will come
        notes: list[str] = []

        def target(write: Writer) -> int:
            started = self._start_command(line)
            follower = CommandFollower(
                self, started, end=end, trailer=trailer, write=write, live=live, stop=stop, forced=forced, note=notes.append,
                spawn=self._workers().submit,
            )
            reusable = False
            try:
                code = follower.wait()
                reusable = code is not None
            finally:
                self._after_command(started, reusable=reusable)
            if code == 127 and not follower.framed and no_bash(follower.output):
                raise BackendError(
                    f"daytona: sandbox {self.sandbox_name} has no bash ({follower.output.strip()[:200]!r}); "
                    "hermes-env needs bash >= 4.4 in the image: use an image that has it (python:3.12-slim, "
                    "debian, ubuntu, Daytona's default snapshot) or add it (apk add bash)"
                )
            if code is None:
                if stop.is_set():
                    return -1  # killed: the base class reports the timeout or the cancel
                if follower.framed:
                    return 0  # the status the command's bash recorded in its frame stands
                raise BackendError("daytona: the daemon reported no exit status for the command")
            if code < 0:
                # The daemon's -1: ended by a signal it does not name. Never a made-up status.
                raise BackendError(
                    f"daytona: the daemon reports exit code {code} for the command (ended by a signal it does "
                    "not name, or never started); its real exit status is unknown"
                )
            return code

        handle = _Handle(target, on_kill=stop.set, name="hermes-daytona-exec")
        handle.notes = notes
        handle.forced = forced
        return handle

    def _workers(self) -> ThreadPoolExecutor:
        """Threads for requests made in parallel with a status poll (a command's logs)."""
        pool = self._pool
        if pool is None:
            with self._ready_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hermes-daytona-poll")
                pool = self._pool
        return pool

    def _start_command(self, line: str) -> StartedCommand:
        """Hand ``line`` to an idle daemon session (made when none is idle); the command's id.

        A failure before the daemon accepted the command is retried once after
        bringing a stopped sandbox back, or in a new session when the daemon
        lost the one taken (it restarted): the command cannot have run.
        """
        sdk = self._sdk
        request = sdk.SessionExecuteRequest(command=line, run_async=True)
        for attempt in (1, 2):
            sb = self._ready()
            sid, new = self._sessions.take(sb)
            try:
                if new:
                    _sdk.call_with_rate_limit(lambda: sb.process.create_session(sid, request_timeout=_AUX_TIMEOUT_S))
                resp = _sdk.call_with_rate_limit(
                    lambda: sb.process.execute_session_command(sid, request, timeout=_AUX_TIMEOUT_S)
                )
            except sdk.DaytonaNotFoundError as exc:
                # The sandbox is gone (recreated by _revived_after), or the daemon no longer
                # has this session (it restarted): either way a new session, once.
                self._sessions.forget(sb.id)
                if attempt == 1:
                    self._revived_after(sb, exc)
                    continue
                raise self._error(exc, "starting the command", BackendError) from exc
            except sdk.DaytonaError as exc:
                if attempt == 1 and self._revived_after(sb, exc):
                    self._sessions.forget(sb.id)
                    continue
                raise self._error(exc, "starting the command", BackendError) from exc
            cmd_id = getattr(resp, "cmd_id", None)
            if not cmd_id:
                raise BackendError("daytona: the daemon accepted the command but gave no command id")
            return StartedCommand(sb, sid, str(cmd_id))
        raise AssertionError("unreachable")

    def _after_command(self, started: StartedCommand, *, reusable: bool) -> None:
        if reusable and self._sandbox is started.sandbox:
            self._sessions.give_back(started.sandbox.id, started.session_id)
            return

        # Still busy (a killed command may run on) or unknown: not reused; removed in the background.
        def drop() -> None:
            try:
                started.sandbox.process.delete_session(started.session_id, request_timeout=_AUX_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - best effort
                log.debug("daytona: deleting session %s failed: %s", started.session_id, exc)

        threading.Thread(target=drop, name="hermes-daytona-drop-session", daemon=True).start()

    def _state_now(self) -> str:
        """The sandbox's state, asked of the API now ("unknown" when that fails)."""
        sb = self._sandbox
        if sb is None:
            return "gone"
        try:
            sb.refresh_data()
        except self._sdk.DaytonaNotFoundError:
            return "deleted"
        except self._sdk.DaytonaError:
            return "unknown"
        return _sdk.state_of(sb)

    def run_script(self, script: str, what: str, *, timeout: int | None = _AUX_TIMEOUT_S) -> Any:
        """Run a short bash ``script`` in the sandbox; the SDK's response (``exit_code``, ``result``)."""
        return self._exec(bash_line(script, login=False), timeout=timeout, what=what)

    def _aux(self, script: str, what: str) -> str:
        """A short helper script's output; BackendError when it cannot run."""
        return self.run_script(script, what).result or ""

    def _preamble(self) -> str:
        """The configured ``env``, exported at the top of the private script (never on a command line)."""
        return exports(self._cfg.env).rstrip("; ")

    def _put_private_file(self, path: str, data: bytes) -> None:
        """The private wrapper script, written into the session's 0700 directory before bash starts."""
        self._live.nonce = nonce_of(data.decode("utf-8", "surrogateescape"))
        self._live.remap = None
        try:
            self._upload(data, path)
        except BackendError:
            if not self._state_lost or self._session is None:
                raise
            # The sandbox was recreated while the script went up: its private
            # directory is in the lost sandbox's home. Move the session to a new
            # one and send this command there (its stub is rewritten to match).
            old = self.session.state_dir
            self._state_lost = False
            new = self._make_private_dir(self._state_dir())
            self.session.state_dir = new
            self._live.remap = (old, new)
            self._upload(data.replace(old.encode(), new.encode()), path.replace(old, new))

    def _upload(self, data: bytes, path: str) -> None:
        """Upload ``data`` to ``path``; retried once after bringing a stopped sandbox back."""
        for attempt in (1, 2):
            sb = self._ready()
            try:
                sb.fs.upload_file(data, path)
                return
            except self._sdk.DaytonaError as exc:
                if attempt == 1 and self._revived_after(sb, exc):
                    continue
                raise self._error(exc, f"uploading {path}", BackendError) from exc

    def _kill_tree(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        # Only the command's own process tree: the sandbox and other commands run on.
        forced = getattr(handle, "forced", None)
        if not graceful and forced is not None:
            forced.set()
        try:
            pid = self._pid_of(wrapped)
            if pid is not None:
                self._aux(kill_tree_script(pid, "TERM" if graceful else "KILL"), "stopping a command")
        except HermesEnvError as exc:
            log.warning("daytona: could not stop the command: %s", exc)

    def _pid_of(self, wrapped: WrappedCommand) -> int | None:
        pid = self._pids.get(wrapped.nonce)
        if pid is not None:
            return pid
        text = self._aux(
            f"IFS= read -r l <{shlex.quote(wrapped.pidfile)} 2>/dev/null; printf '%s' \"$l\"",
            "finding the command's process",
        )
        # None while the file still holds an earlier command's pid (same slot), or none yet.
        pid = wrapped.pid_from(text)
        if pid is not None:
            self._pids.clear()  # one entry is enough: commands are stopped one at a time
            self._pids[wrapped.nonce] = pid
        return pid

    # -- files --------------------------------------------------------------------
    @property
    def sync_engine(self) -> SyncEngine | None:
        return self._sync

    def _before_execute(self) -> None:
        self._ready()
        if self._state_lost and self._session is not None:
            # The session's private directory was in the lost sandbox's home:
            # make one in the new sandbox (the state itself lives in Python).
            self._state_lost = False
            self.session.state_dir = self._make_private_dir(self._state_dir())
        if self._sync is None:
            return
        # A push in progress in another thread is not waited for: commands do not queue behind a sync.
        if self._push_lock.acquire(blocking=False):
            try:
                self._push(force=False)
            finally:
                self._push_lock.release()

    def _push(self, *, force: bool) -> PushResult:
        assert self._sync is not None
        if self._sync_lost:
            self._sync_lost = False
            self._sync.reset()  # a new sandbox: everything goes up again
        return self._sync.push(force=force)

    def push_files(self, *, force: bool = True) -> PushResult:
        """Push the sync mappings now (``force``: ignore the rate limit)."""
        if self._sync is None:
            raise HermesEnvError("daytona: no sync mappings are configured (option 'sync')")
        self._ready()
        with self._push_lock:
            return self._push(force=force)

    def pull_files(self) -> PullResult:
        """Bring the sandbox's changes to the synced paths back to this machine."""
        if self._sync is None:
            raise HermesEnvError("daytona: no sync mappings are configured (option 'sync')")
        self._ready()
        return self._sync.pull()

    # -- the end ------------------------------------------------------------------------
    def cleanup(self) -> None:
        sb, errors = self._sandbox, []
        if sb is not None and self._sync is not None and self._cfg.pull_on_close:
            try:
                self._sync.pull()
            except HermesEnvError as exc:
                errors.append(exc)
                log.warning("daytona: pulling files back from %s failed: %s", self.sandbox_name, exc)
        if sb is not None and _sdk.state_of(sb) == "started":
            try:  # the session's files: they describe this environment only
                private = getattr(self._session, "state_dir", None)
                if private and private != self._state_dir():
                    self.run_script(f"rm -rf -- {shlex.quote(private)}", "tidying up")
                else:
                    pattern = shlex.quote(f"{self._state_dir()}/.hermes-{self.task_id}-")
                    self.run_script(f"rm -f -- {pattern}*", "tidying up")
            except HermesEnvError:
                pass
        if sb is not None:
            try:
                if self._cfg.persistent:
                    if _sdk.state_of(sb) not in _sdk.RESUMABLE | _sdk.GONE:
                        _sdk.call_with_rate_limit(lambda: sb.stop(timeout=self._cfg.start_timeout))
                else:
                    _sdk.call_with_rate_limit(lambda: sb.delete(timeout=self._cfg.start_timeout))
            except self._sdk.DaytonaNotFoundError:
                pass
            except self._sdk.DaytonaError as exc:
                verb = "stopping" if self._cfg.persistent else "deleting"
                errors.append(self._error(exc, f"{verb} sandbox {self.sandbox_name}"))
        self._sandbox = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        # The sync client has no close(); its event connection is the only thing it keeps open.
        dispatcher = getattr(self._client, "_event_dispatcher", None)
        try:
            if dispatcher is not None:
                dispatcher.disconnect()
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown
            log.debug("daytona: closing the SDK's event connection failed: %s", exc)
        if errors:
            raise errors[-1]


def _safe_name(text: str) -> str:
    return _NAME_SAFE.sub("-", text).strip("-.") or "sandbox"
