"""Direct mode: the modal SDK, with this machine's Modal token, drives one sandbox.

Every SDK call is an ``.aio`` coroutine run on the environment's own event loop
thread. Commands run on the core's session server, one long-lived exec whose
stdin and stdout are its stream (``_open_channel``); timeout and cancel kill
the command's tree through a second one and leave the sandbox up.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_env_core.environment.channel import ChannelStream
from hermes_env_core.environment.handles import ProcessHandle
from hermes_env_core.environment.server import BOOT_ARGV as SERVER_ARGV
from hermes_env_core.environment.session import kill_tree_script
from hermes_env_core.environment.snapshot import FilesRef
from hermes_env_core.errors import (
    BackendError,
    ConfigError,
    EnvironmentClosedError,
    EnvironmentUnavailable,
    HermesEnvError,
    PluginLoadError,
    SyncError,
)

from ._image import CHECK_SCRIPT, parse_check, requirement_message
from ._kill import exec_head, find_pids_script, parse_pids
from ._loop import EventLoopThread
from ._stream import ExecStream, HelperProcess
from .backend import MODAL_IMAGE_KIND, ModalEnvironment
from .config import ModalConfig, credentials_missing_message, default_snapshot_store, memory_mib
from .snapshots import SnapshotStore

if TYPE_CHECKING:
    from hermes_env_core.sync import PullResult, SyncEngine

__all__ = ["DirectModalEnvironment"]

log = logging.getLogger(__name__)

_LOST_WAIT_S = 5.0  # how long a lost server's exit status is waited for (it may come late)
_CALL_S = 120.0  # bound on one SDK call that should answer at once (exec start, kill, terminate)
# How long Modal keeps a fork's image: a fork's sandbox that ends is recreated from it, and
# a sandbox lives 24 h at most.
_FORK_TTL_S = 24 * 3600


def _import_sdk() -> Any:
    try:
        import modal
        import modal.exception
        from modal.stream_type import StreamType
    except ImportError as exc:
        raise PluginLoadError(
            f"modal: the modal SDK cannot be imported ({exc}): pip install 'modal>=1.6,<1.7'"
        ) from exc
    return modal, StreamType


class DirectModalEnvironment(ModalEnvironment):
    """One Modal sandbox per environment, reached with the SDK."""

    stdin_mode = "pipe"  # the SDK streams stdin: the private script goes there

    mode = "direct"
    config_model = ModalConfig

    def __init__(self, config: ModalConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        cfg: ModalConfig = self.config  # type: ignore[assignment]
        self._cfg = cfg
        self._sandbox: Any = None
        self._client: Any = None
        self._app: Any = None
        self._sync: SyncEngine | None = None
        self._sb_lock = threading.Lock()
        self._store = SnapshotStore(cfg.snapshot_store or default_snapshot_store()) if cfg.persistent else None
        self._store_key = f"direct:{self.task_id}"
        self._restored_from: str | None = None
        self._state = "/tmp"
        self._server: tuple[Any, ExecStream | None] = (None, None)  # the latest server's sandbox and stream
        self._streams: weakref.WeakSet[ExecStream] = weakref.WeakSet()  # the session's long-lived execs
        self._last_used = time.monotonic()
        self._let_go = False
        self._loop = EventLoopThread(f"hermes-env-modal-{self.task_id}")
        self._loop.start()
        try:
            self._modal, self._stream_type = _import_sdk()
            token_id, token_secret = self._credentials()
            self._loop.run(self._connect(token_id, token_secret), timeout=cfg.start_timeout)
            mappings = cfg.sync_mappings()
            self._check_image(needs_tar=bool(mappings))
            if cfg.idle_timeout:
                threading.Thread(
                    target=_let_go_when_idle, args=(weakref.ref(self), cfg.idle_timeout / 2), daemon=True,
                    name=f"hermes-env-modal-idle-{self.task_id}",
                ).start()
            if mappings:
                from hermes_env_core.sync import SyncEngine

                from .sync import ModalSyncTransport

                self._sync = SyncEngine(ModalSyncTransport(self), mappings, interval=cfg.sync_interval_s)
        except BaseException as exc:
            self._teardown(snapshot=False, errors=[])
            raise self._translate(exc, "could not start a sandbox") from exc

    # -- public extras -------------------------------------------------------------
    @property
    def sandbox_id(self) -> str | None:
        sb = self._sandbox
        return sb.object_id if sb is not None else None

    @property
    def restored_from(self) -> str | None:
        """The snapshot image id the current sandbox was created from, if any."""
        return self._restored_from

    @property
    def sync_engine(self) -> SyncEngine | None:
        return self._sync

    def pull_files(self) -> PullResult | None:
        """Bring the sandbox's changes to the synced trees back to the host now."""
        return self._sync.pull() if self._sync is not None else None

    # -- snapshots -----------------------------------------------------------------
    def snapshot_files(
        self, workdir: Path, name: str, *, paths: Sequence[str] | None, temporary: bool
    ) -> FilesRef | None:
        """The sandbox's whole filesystem as a Modal image (``Sandbox.snapshot_filesystem``,
        kept by Modal for ``snapshot_ttl``; a fork's for a day at most): its id is the record,
        nothing is written here. With ``paths``, the core's archives of those directories."""
        if paths is not None:
            return None
        cfg, sandbox = self._cfg, self._sandbox
        if sandbox is None:
            raise EnvironmentClosedError(f"modal environment {self.task_id!r} is closed")
        ttl = cfg.snapshot_ttl
        if temporary:
            ttl = _FORK_TTL_S if ttl is None else min(ttl, _FORK_TTL_S)
        try:
            image = self._loop.run(
                sandbox.snapshot_filesystem.aio(timeout=cfg.snapshot_timeout, ttl=ttl),
                timeout=cfg.snapshot_timeout + 30.0,
            )
        except Exception as exc:
            raise self._translate(exc, f"snapshot_filesystem of sandbox {sandbox.object_id} failed") from exc
        return FilesRef(MODAL_IMAGE_KIND, ref=image.object_id)

    # -- setup ---------------------------------------------------------------------
    def _credentials(self) -> tuple[str, str]:
        cfg = self._cfg
        if cfg.token_id is not None and cfg.token_secret is not None:
            return cfg.token_id.get_secret_value(), cfg.token_secret.get_secret_value()
        from modal.config import config as modal_config

        token_id, token_secret = modal_config.get("token_id"), modal_config.get("token_secret")
        if not token_id or not token_secret:
            raise ConfigError(credentials_missing_message())
        return token_id, token_secret

    async def _connect(self, token_id: str, token_secret: str) -> None:
        modal = self._modal
        self._client = await modal.Client.from_credentials.aio(token_id, token_secret)
        self._app = await modal.App.lookup.aio(self._cfg.app_name, create_if_missing=True, client=self._client)
        self._sandbox = await self._create_sandbox(restore=True)

    def _base_image(self) -> tuple[Any, str]:
        modal, cfg = self._modal, self._cfg
        if cfg.image_id:
            return modal.Image.from_id(cfg.image_id, client=self._client), cfg.image_id
        if cfg.image:
            return modal.Image.from_registry(cfg.image), cfg.image
        return modal.Image.debian_slim(), "debian_slim"

    async def _create_sandbox(self, *, restore: bool) -> Any:
        modal, cfg = self._modal, self._cfg
        kwargs: dict[str, Any] = {
            "app": self._app,
            "client": self._client,
            "timeout": cfg.sandbox_timeout,
        }
        for key in ("workdir", "cpu", "region", "idle_timeout"):
            value = getattr(cfg, key)
            if value is not None:
                kwargs[key] = value
        if cfg.memory is not None:
            kwargs["memory"] = memory_mib(cfg.memory)
        if cfg.block_network:
            kwargs["block_network"] = True
        if cfg.env:
            kwargs["env"] = dict(cfg.env)
        base, base_name = self._base_image()
        self._restored_from = None
        record = self._store.get(self._store_key) if (restore and self._store is not None) else None
        if record is not None and record.expired():
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(record.expires_at))
            self._note(
                f"modal: snapshot {record.image_id} of task {self.task_id!r} expired at {when} "
                f"(Modal keeps a snapshot for its ttl); started from the base image {base_name} instead"
            )
            record = None
        if record is not None:
            try:
                image = modal.Image.from_id(record.image_id, client=self._client)
                sandbox = await modal.Sandbox.create.aio(image=image, **kwargs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported in the next result, base image used
                self._note(
                    f"modal: could not restore snapshot {record.image_id} of task {self.task_id!r} "
                    f"({type(exc).__name__}: {exc}); started from the base image {base_name} instead"
                )
                log.warning("modal: restoring %s failed: %r", record.image_id, exc)
            else:
                self._restored_from = record.image_id
                return sandbox
        return await modal.Sandbox.create.aio(image=base, **kwargs)

    def _check_image(self, *, needs_tar: bool) -> None:
        """Refuse an image hermes-env cannot work in, with what it lacks; pick the state directory."""
        cfg = self._cfg
        image = cfg.image_id or cfg.image or "debian_slim"
        try:
            code, out, err = self.run_script(CHECK_SCRIPT, shell="sh", timeout=cfg.image_check_timeout)
        except EnvironmentUnavailable as exc:
            raise EnvironmentUnavailable(f"{exc} (checking the image {image}; is sh in it?)") from exc
        facts = parse_check(out.decode("utf-8", "replace"))
        if facts is None:
            raise EnvironmentUnavailable(
                f"modal: the image check could not run in image {image} (exit {code}): "
                f"{(out + err).decode('utf-8', 'replace')[-300:]!r}; an image needs sh, bash >= 4.4 and /proc"
            )
        problems = facts.problems(needs_tar=needs_tar)
        if problems:
            raise ConfigError(requirement_message(image, problems))
        for warning in facts.warnings(needs_tar=needs_tar):
            log.info("modal: image %s has %s", image, warning)
        self._state = cfg.state_dir or ("/dev/shm" if facts.shm else "/tmp")

    def _state_dir(self) -> str:
        return self._state

    # -- the session server's streams ------------------------------------------------
    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        self._last_used = time.monotonic()
        if self._let_go and tuple(argv) == SERVER_ARGV:
            self._let_go = False
            self._note(
                f"modal: the session's execs were let go after {(self._cfg.idle_timeout or 0) / 2:g}s without a command, "
                "so that Modal could end the idle sandbox (idle_timeout); its shell state was kept"
            )
        stream = self.open_stream(list(argv))
        self._streams.add(stream)
        return stream

    def _command_begin(self) -> None:
        self._last_used = time.monotonic()

    def _command_usage(self, exit_code: int | None, started: float) -> None:
        self._last_used = time.monotonic()

    def _let_go_if_idle(self, idle_s: float) -> None:
        # A running exec keeps a sandbox busy: idle_timeout could never end it.
        if time.monotonic() - self._last_used < idle_s or self._has_live_processes():
            return
        with self._running_cv:
            streams = [s for s in self._streams if not s.closed]
            if self._running or not streams:
                return
            self._let_go = True
            for stream in streams:
                stream.close()

    def open_stream(self, argv: list[str], *, stderr: bool = False) -> ExecStream:
        """Start ``argv`` as an exec (recreating an ended sandbox once); stdin and stdout its stream,
        stderr dropped unless kept (``stream.stderr``)."""
        st = self._stream_type
        for attempt in (1, 2):
            sandbox = self._sandbox
            if sandbox is None:
                raise EnvironmentClosedError(f"modal environment {self.task_id!r} is closed")
            try:
                proc = self._loop.run(
                    sandbox.exec.aio(*argv, text=False, stdout=st.PIPE, stderr=st.PIPE if stderr else st.DEVNULL),
                    timeout=_CALL_S,
                )
            except Exception as exc:
                if attempt == 1 and self._ended(sandbox, exc):
                    self._recreate(sandbox)
                    continue
                raise self._translate(exc, "could not start the command") from exc
            stream = ExecStream(self._loop, proc, stderr=stderr)
            if tuple(argv) == SERVER_ARGV:
                self._server = (sandbox, stream)
            return stream
        raise AssertionError("unreachable")

    def _explain_lost(self, started: float) -> tuple[int, str] | None:
        # The server's exec's own exit status, unless the whole sandbox ended (then it is lost).
        sandbox, stream = self._server
        if stream is None:
            return None
        try:
            code = stream.exit_status.result(_LOST_WAIT_S)
            if code <= 128 or self._loop.run(sandbox.poll.aio(), timeout=_LOST_WAIT_S) is not None:
                return None
        except Exception:  # noqa: BLE001 - cannot tell: an infrastructure error
            return None
        return code, f"the session's shell was killed by signal {code - 128}"

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        # Only helpers outside the session (background processes) come here; their script
        # travels on stdin when it carries state (``stdin_mode``), else it is short.
        token = secrets.token_hex(8)
        argv = ["bash", "-l", "-c"] if login else ["bash", "-c"]
        redirect = "" if stdin_data is not None else "</dev/null "
        stream = self.open_stream([*argv, exec_head(token) + f"exec {redirect}2>&1; " + script])
        return HelperProcess(
            stream, stdin_data, on_kill=lambda: self._kill_quietly(token), name=f"hermes-env-modal-exec-{token}"
        )

    def _ended(self, sandbox: Any, exc: BaseException) -> bool:
        """Whether ``exc`` says the sandbox itself is gone (timed out, terminated)."""
        if not self._cfg.recreate or sandbox is None:
            return False
        mex = self._modal.exception
        # NotFoundError: the router's answer for a finished task. ServiceError and
        # ConnectionError: what the SDK raises when its retries run out -- a
        # sandbox that died with its worker looks like that; poll() tells.
        gone = isinstance(exc, (mex.NotFoundError, mex.SandboxTerminatedError))
        if not gone and not isinstance(exc, (mex.ServiceError, mex.ConnectionError)):
            return False
        try:
            return self._loop.run(sandbox.poll.aio(), timeout=_CALL_S) is not None
        except Exception:  # noqa: BLE001 - cannot even ask
            # After NotFound the sandbox is gone either way; after a service or
            # connection error Modal may just be unreachable: a sandbox that may
            # still run is not abandoned, the error is raised.
            return gone

    def _recreate(self, dead: Any) -> None:
        with self._sb_lock:
            if self._sandbox is not dead:
                return  # another thread already replaced it
            old = dead.object_id
            try:
                self._sandbox = self._loop.run(self._create_sandbox(restore=True), timeout=self._cfg.start_timeout)
            except Exception as exc:
                raise self._translate(exc, f"sandbox {old} has ended and a new one could not be started") from exc
            if self._sync is not None:
                self._sync.reset()
            self._note(
                f"modal: sandbox {old} had ended (timeout, idle_timeout or terminated); continuing in a new sandbox "
                f"{self._sandbox.object_id}: files written since the last snapshot are gone, the shell state is kept"
            )

    def _before_execute(self) -> None:
        if self._sync is not None:
            self._sync.push()

    # -- killing a helper ------------------------------------------------------------
    def _kill_quietly(self, token: str) -> None:
        # ThreadedProcessHandle.kill(): the base class gave up waiting for the exit.
        try:
            pids = self._find_pids(None, token)
            if pids:
                self.run_script("".join(kill_tree_script(p, "KILL") for p in pids))
        except Exception as exc:  # noqa: BLE001 - the wait that follows reports the outcome
            log.warning("modal: kill of exec %s failed: %r", token, exc)

    def _find_pids(self, pidfile: str | None, token: str) -> tuple[int, ...]:
        _, out, _ = self.run_script(find_pids_script(token, pidfile))
        return parse_pids(out)

    def run_script(
        self, script: str, stdin: bytes | None = None, *, shell: str = "bash", timeout: float = _CALL_S
    ) -> tuple[int, bytes, bytes]:
        """Run ``script`` in the sandbox outside the session: (exit code, stdout, stderr)."""
        try:
            return self._loop.run(self._collect([shell, "-c", script], stdin), timeout=timeout)
        except HermesEnvError:
            raise
        except Exception as exc:
            raise self._translate(exc, "a helper command failed") from exc

    async def _collect(self, argv: list[str], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        proc = await self._sandbox.exec.aio(*argv, text=False)
        out = asyncio.ensure_future(proc.stdout.read.aio())
        err = asyncio.ensure_future(proc.stderr.read.aio())
        if stdin is not None:
            for start in range(0, len(stdin), 1 << 20):  # one RPC each; the SDK buffers at most 16 MiB
                proc.stdin.write(stdin[start : start + (1 << 20)])
                await proc.stdin.drain.aio()
            proc.stdin.write_eof()
            await proc.stdin.drain.aio()
        code = await proc.wait.aio()
        return int(code), await out, await err

    # -- errors ----------------------------------------------------------------------
    def _translate(self, exc: BaseException, what: str) -> BaseException:
        if isinstance(exc, HermesEnvError) or not isinstance(exc, Exception):
            return exc
        modal = getattr(self, "_modal", None)
        if modal is not None and isinstance(exc, modal.exception.AuthError):
            return ConfigError(f"modal: Modal rejected the credentials: {exc}. {credentials_missing_message()}")
        if isinstance(exc, TimeoutError):
            return EnvironmentUnavailable(f"modal: {what}: no answer from Modal in time ({exc})")
        return EnvironmentUnavailable(f"modal: {what}: {type(exc).__name__}: {exc}")

    # -- teardown --------------------------------------------------------------------
    def cleanup(self) -> None:
        errors: list[BaseException] = []
        if self._sync is not None and self._cfg.pull_on_close:
            try:
                self._sync.pull()
            except Exception as exc:  # noqa: BLE001 - re-raised once everything is released
                errors.append(exc)
        self._teardown(snapshot=self._cfg.persistent, errors=errors)
        if errors:
            first = errors[0]
            if len(errors) > 1:
                rest = "; ".join(f"{type(e).__name__}: {e}" for e in errors[1:])
                raise SyncError(f"modal: closing {self.task_id!r} failed: {first}; also: {rest}") from first
            raise first

    def _teardown(self, *, snapshot: bool, errors: list[BaseException]) -> None:
        """Snapshot (if asked), terminate the sandbox, close the client, stop the loop: each once."""
        sandbox, self._sandbox = self._sandbox, None
        client, self._client = self._client, None
        try:
            if sandbox is not None and self._loop.running:
                if snapshot and self._store is not None:
                    try:
                        cfg = self._cfg
                        image = self._loop.run(
                            sandbox.snapshot_filesystem.aio(timeout=cfg.snapshot_timeout, ttl=cfg.snapshot_ttl),
                            timeout=cfg.snapshot_timeout + 30.0,
                        )
                        self._store.put(
                            self._store_key,
                            image.object_id,
                            sandbox_id=sandbox.object_id,
                            base_image=cfg.image_id or cfg.image or "debian_slim",
                            ttl=cfg.snapshot_ttl,
                        )
                    except Exception as exc:  # noqa: BLE001
                        errors.append(BackendError(f"modal: snapshot of sandbox {sandbox.object_id} failed: {exc}"))
                try:
                    self._loop.run(sandbox.terminate.aio(), timeout=_CALL_S)
                except Exception as exc:  # noqa: BLE001 - Modal ends it at its timeout anyway
                    log.warning("modal: terminating %s failed: %r", sandbox.object_id, exc)
            if client is not None and self._loop.running:
                try:
                    self._loop.run(client.close.aio(), timeout=30.0)
                except Exception as exc:  # noqa: BLE001
                    log.debug("modal: closing the client failed: %r", exc)
        finally:
            self._loop.stop()


def _let_go_when_idle(ref: weakref.ReferenceType[DirectModalEnvironment], idle_s: float) -> None:
    while (env := ref()) is not None and not env._closing.wait(min(idle_s / 2, 1.0)):
        env._let_go_if_idle(idle_s)
        del env
