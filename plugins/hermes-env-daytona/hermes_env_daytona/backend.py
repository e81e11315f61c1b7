"""The Daytona backend: one sandbox per task id, created or resumed by name.

The session server runs in the sandbox over a PTY session of its daemon made
to carry raw bytes (``_pty``); the SDK's ``process.exec`` is left for short
helpers. The daytona SDK is imported when an environment is created, never before.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import shlex
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.environment.channel import ChannelStream
from hermes_env_core.environment.handles import ProcessHandle
from hermes_env_core.errors import BackendError, EnvironmentClosedError, EnvironmentUnavailable, HermesEnvError

from . import _sdk
from ._pty import NoBash, open_pty_stream
from .config import DaytonaConfig, memory_gib

if TYPE_CHECKING:
    from hermes_env_core.sync import PullResult, PushResult, SyncEngine

__all__ = ["DaytonaEnvironment"]

log = logging.getLogger(__name__)

_AUX_TIMEOUT_S = 30  # helper scripts run by process.exec
_TASK_LABEL = "hermes-env-task"
_NAME_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


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
        self._resources = self._capped_resources()
        self._sync: SyncEngine | None = None
        self._push_lock = threading.Lock()
        self._sync_lost = False
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

    # -- the stream ----------------------------------------------------------------
    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        """``argv`` behind a PTY session made raw (``_pty``); a stopped sandbox is started
        first, a deleted one made again (with a note)."""
        for attempt in (1, 2):
            sb = self._ready()
            try:
                return open_pty_stream(sb, argv)
            except NoBash:
                raise EnvironmentUnavailable(
                    f"daytona: sandbox {self.sandbox_name} has no bash; hermes-env needs bash >= 4.4 in the "
                    "image: use an image that has it (python:3.12-slim, debian, ubuntu, Daytona's default "
                    "snapshot) or add it (apk add bash)"
                ) from None
            except (self._sdk.DaytonaError, EnvironmentUnavailable) as exc:
                if attempt == 1 and self._revived_after(sb, exc):
                    continue
                if isinstance(exc, EnvironmentUnavailable):
                    raise
                raise self._error(exc, "opening a PTY session") from exc
        raise AssertionError("unreachable")

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        # Outside the session (helpers): a command on a resident channel, another PTY stream.
        pool = self._channel_pool()
        channel = pool.acquire() if pool is not None else None
        if channel is None:
            raise EnvironmentUnavailable(
                "daytona: commands run over the sandbox's PTY sessions, which this environment cannot "
                "use (channel=False, or refused); turn channel back on"
            )
        return channel.start(script, login=login, stdin_data=stdin_data)

    def run_script(self, script: str, what: str, *, timeout: int | None = _AUX_TIMEOUT_S) -> Any:
        """Run a short bash ``script`` in the sandbox; the SDK's response (``exit_code``, ``result``)."""
        return self._exec(f"exec bash -c {shlex.quote(script)}", timeout=timeout, what=what)

    def _preamble(self) -> str:
        """The configured ``env``, exported when the server starts (never on a command line)."""
        env = self._cfg.env
        return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) if env else ""

    # -- files --------------------------------------------------------------------
    @property
    def sync_engine(self) -> SyncEngine | None:
        return self._sync

    def _before_execute(self) -> None:
        self._ready()
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
            private = getattr(self._runner, "private_dir", None)
            try:  # the session's private directory: it describes this environment only
                if private:
                    self.run_script(f"rm -rf -- {shlex.quote(private)}", "tidying up")
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
