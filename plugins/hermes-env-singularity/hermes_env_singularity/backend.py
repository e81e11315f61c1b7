"""The singularity backend: one Apptainer instance per environment.

Commands go through a resident shell channel: one long-lived ``apptainer exec
instance://NAME bash`` whose stdin and stdout carry every command (see
``hermes_env_core.environment.channel``). Without it (``channel=False``, or a
bash too old), each command is ``apptainer exec instance://NAME bash -c
SCRIPT``, a local process in its own session; the processes it starts in the
instance stay in that host process group, so signalling the group ends the tree.
"""

from __future__ import annotations

import dataclasses
import fcntl
import fnmatch
import logging
import os
import re
import signal
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from hermes_env_core.backends.local import ProcessTree, feed_stdin, filter_environment
from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.environment.channel import ChannelStream, PipeStream
from hermes_env_core.environment.handles import ProcessHandle
from hermes_env_core.environment.session import WrappedCommand
from hermes_env_core.environment.snapshot import CorruptSnapshotError, FilesRef, Snapshot
from hermes_env_core.errors import BackendError, ConfigError, EnvironmentUnavailable, UnsupportedOperation

from .config import SingularityConfig
from .images import ResolvedImage, resolve_image
from .instances import instance_name, list_instances, stop_instance, sweep_in_background
from .runtime import Runtime, RuntimeNotFoundError, client_env, find_runtime, last_error
from .snapshots import (
    OVERLAY_KIND,
    OVERLAY_PART,
    archive_overlay,
    check_overlay_archive,
    overlay_path,
    remove_overlay,
    unpack_overlay,
)

__all__ = ["SingularityConfig", "SingularityEnvironment"]

log = logging.getLogger(__name__)

_SCRIPT_ARG_LIMIT = 100_000  # one argv string may not exceed 128 KiB on Linux
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Host variables that describe this machine or configure apptainer itself,
# never the container: inheriting them would break the container's own.
_HOST_ONLY = frozenset({"PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_", "LD_LIBRARY_PATH", "LD_PRELOAD", "TMPDIR"})
_HOST_ONLY_PREFIXES = ("APPTAINER", "SINGULARITY", "BASH_FUNC_")
_CGROUP_HINTS = ("cgroup", "cpu.cfs", "memory.limit")

# Per runtime, why --cpus/--memory failed once: later environments skip them.
_limits_unsupported: dict[tuple[str, str | None], str] = {}


class _ExecProcess(subprocess.Popen):  # type: ignore[type-arg]
    """An ``apptainer exec`` client whose terminate/kill reach its process group.

    apptainer's own messages arrive on a separate stderr (the wrapper merges
    the command's stderr into stdout inside bash); a FATAL there means the
    exec failed, which ``wait()`` raises instead of returning exit 255.
    """

    _err: IO[bytes] | None = None
    _on_gone: Callable[[], None] | None = None
    _instance = ""
    _signalled = False
    _tree: ProcessTree | None = None

    def _signal_group(self, sig: int) -> None:
        self._signalled = True  # what the client says after our signal is no failure
        # The command's processes are this host's: its group, and its tree as
        # seen before each signal (children that call setsid leave the group).
        if self._tree is None:
            self._tree = ProcessTree(self.pid)
        self._tree.stop(sig)

    def tree_alive(self) -> bool:
        if self._tree is None:
            return self.poll() is None
        self._tree.refresh()
        return bool(self._tree.alive())

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        err, self._err = self._err, None
        if err is not None:
            try:
                err.seek(0)
                text = err.read(65536).decode("utf-8", "replace")
            finally:
                err.close()
            if code == 255 and "FATAL:" in text and not self._signalled:
                message = last_error(text[text.find("FATAL:"):])
                if "no instance found" in text and self._on_gone is not None:
                    self._on_gone()
                    message += " (the instance is gone; the next command starts a new one)"
                elif "executable file not found" in text:
                    message += " (the image needs bash on its PATH)"
                raise BackendError(f"singularity: exec in instance {self._instance} failed: {message}")
        return code


class SingularityEnvironment(BaseEnvironment):
    """Runs commands in an Apptainer/Singularity instance started for this environment."""

    name = "singularity"
    stdin_mode = "pipe"
    config_model = SingularityConfig

    def __init__(self, config: SingularityConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        cfg: SingularityConfig = self.config  # type: ignore[assignment]
        self.runtime: Runtime = find_runtime(cfg.executable)
        if cfg.apptainer_conf:
            conf = os.path.abspath(os.path.expanduser(cfg.apptainer_conf))
            if not os.path.isfile(conf):
                raise ConfigError(f"singularity: apptainer_conf {conf} is not a file")
            self.runtime = dataclasses.replace(self.runtime, config_file=conf)
        self._client_env = client_env()
        self._exec_env = {**self._client_env, **_container_env(cfg)}
        self._instance: str | None = None
        self._gone = False
        self._finalizer: weakref.finalize | None = None
        self._overlay_fd = -1
        self._drop_overlay = False  # made from a snapshot for this environment alone: removed at cleanup
        self._lock = threading.Lock()
        self.limits_applied = False
        self._binds = [b.spec(_bind_source(b.source)) for b in cfg.binds]
        sweep_in_background(self.runtime, self._client_env)
        self.image: ResolvedImage = resolve_image(
            cfg.image,
            self.runtime,
            cache_dir=cfg.cache_dir,
            env=self._client_env,
            build_timeout=cfg.build_timeout,
            no_https=cfg.no_https,
        )
        if self.image.warning:
            log.warning("singularity: %s", self.image.warning)
            self._note(self.image.warning)
        self._overlay = self._lock_overlay() if cfg.overlay == "persistent" else None
        try:
            self._start_instance()
        except BaseException:
            self._release_overlay()
            raise

    # -- public -------------------------------------------------------------------
    @property
    def instance_name(self) -> str | None:
        """The running instance's name (``instance://NAME``), None once closed."""
        return self._instance

    @property
    def overlay_path(self) -> str | None:
        """The persistent overlay directory, when ``overlay='persistent'``."""
        return self._overlay

    @classmethod
    def check_requirements(cls) -> list[str]:
        """What stops this backend on this machine (empty when it can run), for ``hermes-env doctor``."""
        try:
            runtime = find_runtime()
        except RuntimeNotFoundError as exc:
            return [str(exc)]
        try:
            runtime.version()
        except EnvironmentUnavailable as exc:
            return [str(exc)]
        problems = []
        if os.geteuid() != 0:
            try:
                with open("/proc/sys/user/max_user_namespaces") as f:
                    if int(f.read().strip() or 0) == 0:
                        problems.append(
                            "singularity: user namespaces are disabled (user.max_user_namespaces = 0); "
                            "non-root apptainer needs them, or a setuid installation"
                        )
            except (OSError, ValueError):
                pass
        return problems

    # -- the instance ------------------------------------------------------------
    def _start_args(self, *, limits: bool) -> list[str]:
        cfg: SingularityConfig = self.config  # type: ignore[assignment]
        args = ["instance", "start", "--containall", "--no-home", "--cleanenv"]
        if cfg.overlay == "tmpfs":
            args.append("--writable-tmpfs")
        elif cfg.overlay == "persistent":
            assert self._overlay is not None
            args += ["--overlay", self._overlay]
        if cfg.userns:
            args.append("--userns")
        if cfg.no_https and self.image.kind == "direct":
            args.append("--no-https")
        for spec in self._binds:
            args += ["--bind", spec]
        if limits:
            if cfg.cpu is not None:
                args += ["--cpus", f"{cfg.cpu:g}"]
            if cfg.memory is not None:
                args += ["--memory", cfg.memory]
        args += list(cfg.extra_args)
        return args

    def _start_instance(self) -> None:
        cfg: SingularityConfig = self.config  # type: ignore[assignment]
        wants_limits = cfg.cpu is not None or cfg.memory is not None
        known_bad = _limits_unsupported.get((self.runtime.path, self.runtime.config_file))
        limits = wants_limits and known_bad is None
        if wants_limits and known_bad is not None:
            self._limits_refused(known_bad)
        name = instance_name(self.task_id)
        proc = self.runtime.run(
            [*self._start_args(limits=limits), self.image.source, name], env=self._client_env, timeout=cfg.start_timeout
        )
        if proc.returncode != 0 and limits and any(h in proc.stderr.lower() for h in _CGROUP_HINTS):
            reason = next(ln for ln in proc.stderr.splitlines() if any(h in ln.lower() for h in _CGROUP_HINTS))
            reason = re.sub(r"^\s*(FATAL|ERROR):\s*", "", reason).strip()
            _limits_unsupported[(self.runtime.path, self.runtime.config_file)] = reason
            self._limits_refused(reason)
            limits = False
            proc = self.runtime.run(
                [*self._start_args(limits=False), self.image.source, name],
                env=self._client_env,
                timeout=cfg.start_timeout,
            )
        if proc.returncode != 0:
            also = f"; before that, the {self.image.warning}" if self.image.warning else ""
            raise EnvironmentUnavailable(
                f"singularity: 'instance start' of {self.image.source} failed (exit {proc.returncode}): "
                f"{last_error(proc.stderr)}{also}"
            )
        self.limits_applied = limits
        self._instance = name
        self._gone = False
        self._exec_prefix = self.runtime.argv("exec", "--cleanenv", "--pwd", "/", f"instance://{name}")
        self._finalizer = weakref.finalize(
            self, _stop_quietly, self.runtime, name, self._client_env, cfg.stop_timeout
        )

    def _limits_refused(self, reason: str) -> None:
        cfg: SingularityConfig = self.config  # type: ignore[assignment]
        asked = " ".join(
            p for p in (f"--cpus {cfg.cpu:g}" if cfg.cpu else "", f"--memory {cfg.memory}" if cfg.memory else "") if p
        )
        if cfg.require_limits:
            raise EnvironmentUnavailable(
                f"singularity: this host cannot apply {asked} ({reason}) and require_limits is set"
            )
        self._note(f"resource limits not applied ({asked}): the host does not support them here: {reason}")

    def _mark_gone(self) -> None:
        self._gone = True

    def _before_execute(self) -> None:
        if not self._gone:
            return
        with self._lock:
            if not self._gone or self._closed:
                return
            old = self._instance
            if self._finalizer is not None:
                self._finalizer.detach()
            self._start_instance()
            self._note(
                f"instance {old} was gone; started {self._instance} (session state restored; "
                "files outside binds and persistent overlays were lost)"
            )

    def _lock_overlay(self) -> str:
        cfg: SingularityConfig = self.config  # type: ignore[assignment]
        assert cfg.task_id
        path = overlay_path(cfg.overlay_dir, cfg.task_id)
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise EnvironmentUnavailable(
                f"singularity: the persistent overlay {path} of task {cfg.task_id!r} is in use by another "
                "environment (two instances must not share one overlay)"
            ) from exc
        self._overlay_fd = fd
        return path

    def _release_overlay(self) -> None:
        if self._overlay_fd >= 0:
            os.close(self._overlay_fd)
            self._overlay_fd = -1

    # -- snapshots: a copy of the persistent overlay ---------------------------------
    def snapshot_files(
        self, workdir: Path, name: str, *, paths: Sequence[str] | None, temporary: bool
    ) -> FilesRef | None:
        """A persistent overlay's ``upper`` directory as one tar part; with ``paths``, the core's
        archives of those directories (any overlay mode)."""
        if paths is not None:
            return None
        cfg: SingularityConfig = self.config  # type: ignore[assignment]
        if cfg.overlay != "persistent" or self._overlay is None:
            raise UnsupportedOperation(
                f"singularity: a snapshot of the files copies the persistent overlay, and this environment has "
                f"overlay={cfg.overlay!r}; use overlay='persistent' (with a task_id), or pass paths=[...] to archive "
                "those directories, or files=False for the session state alone"
            )
        size = archive_overlay(self._overlay, workdir / OVERLAY_PART)
        return FilesRef(OVERLAY_KIND, parts=(OVERLAY_PART,), size=size)

    @classmethod
    def start_from_snapshot(
        cls, snapshot: Snapshot, options: dict[str, Any], create: Callable[..., BaseEnvironment]
    ) -> BaseEnvironment:
        """A new persistent overlay from the snapshot's copy, then an instance on it. Without a
        ``task_id`` one is made and the overlay goes with the environment at cleanup."""
        if snapshot.files.kind != OVERLAY_KIND or snapshot.files.parts != (OVERLAY_PART,):
            raise CorruptSnapshotError(
                f"snapshot {snapshot.name!r}: singularity reads {OVERLAY_KIND!r} snapshots with one part "
                f"{OVERLAY_PART}, not {snapshot.files.kind!r} {list(snapshot.files.parts)}; refused"
            )
        if options.get("overlay", "persistent") != "persistent":
            raise ConfigError(
                f"singularity: snapshot {snapshot.name!r} holds a persistent overlay; it starts with "
                f"overlay='persistent', not {options['overlay']!r}"
            )
        archive = snapshot.part(OVERLAY_PART)
        check_overlay_archive(archive, f"snapshot {snapshot.name!r}")
        task_id = options.get("task_id")
        made = task_id is None
        if made:
            task_id = f"{snapshot.name[:20]}-{os.urandom(4).hex()}"
        path = overlay_path(options.get("overlay_dir"), str(task_id))
        fresh = not os.path.exists(path)
        try:
            unpack_overlay(archive, path)
        except BaseException:
            if fresh:
                remove_overlay(path)
            raise
        try:
            env = create(**{**options, "overlay": "persistent", "task_id": task_id})
        except BaseException:
            remove_overlay(path)
            raise
        if made:
            env._drop_overlay = True  # type: ignore[attr-defined]
        return env

    # -- commands -------------------------------------------------------------------
    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        args = [*self._exec_prefix, "bash", "-l"] if login else [*self._exec_prefix, "bash"]
        pass_fds: tuple[int, ...] = ()
        script_r = script_w = -1
        if len(script) > _SCRIPT_ARG_LIMIT:
            # Too long for one argv string: bash reads it from an inherited pipe.
            script_r, script_w = os.pipe()
            pass_fds = (script_r,)
            args += ["-c", f"builtin source /dev/fd/{script_r}", "bash"]
        else:
            args += ["-c", script, "bash"]
        err = tempfile.TemporaryFile(dir=_ERR_DIR)
        try:
            proc = _ExecProcess(
                args,
                stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=self._exec_env,
                start_new_session=True,
                pass_fds=pass_fds,
                cwd="/",
            )
        except OSError as exc:
            err.close()
            raise EnvironmentUnavailable(f"singularity: cannot start {self.runtime.path}: {exc}") from exc
        finally:
            if script_r >= 0:
                os.close(script_r)
        proc._err = err
        proc._on_gone = self._mark_gone
        proc._instance = self._instance or ""
        if script_w >= 0:
            feed_stdin(os.fdopen(script_w, "wb"), script.encode("utf-8", "surrogateescape"))
        if stdin_data is not None:
            feed_stdin(proc.stdin, stdin_data)
        return proc

    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        pool = self._channels
        opened = (pool is not None and pool.opened) or self.__dict__.get("_streams_opened", False)
        if opened and not self._instance_running():
            # A stream was lost with the instance: start a new one first (with its note).
            self._mark_gone()
            self._before_execute()
        self.__dict__["_streams_opened"] = True
        try:
            proc = subprocess.Popen(
                [*self._exec_prefix, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=self._exec_env,
                start_new_session=True,
                cwd="/",
            )
        except OSError as exc:
            raise EnvironmentUnavailable(f"singularity: cannot start {self.runtime.path}: {exc}") from exc
        assert proc.stdin is not None and proc.stdout is not None

        def stop() -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()

        return PipeStream(proc.stdin, proc.stdout, on_close=stop, exited=lambda: proc.poll() is not None)

    def _instance_running(self) -> bool:
        try:
            names = {str(i.get("instance")) for i in list_instances(self.runtime, self._client_env)}
        except BackendError:
            return True  # cannot tell: let the open say
        return self._instance in names

    def _kill_tree(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        if graceful:
            handle.terminate()  # type: ignore[attr-defined]
        else:
            handle.kill()

    def _tree_alive(self, handle: ProcessHandle, wrapped: WrappedCommand) -> bool | None:
        return handle.tree_alive() if isinstance(handle, _ExecProcess) else None

    def cleanup(self) -> None:
        cfg: SingularityConfig = self.config  # type: ignore[assignment]
        name, self._instance = self._instance, None
        try:
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
            if name is not None:
                stop_instance(self.runtime, name, env=self._client_env, grace=cfg.stop_timeout)
        finally:
            self._release_overlay()
            if self._drop_overlay and self._overlay is not None:
                remove_overlay(self._overlay)


def _err_dir() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


_ERR_DIR = _err_dir()


def _bind_source(source: str) -> str:
    path = os.path.abspath(os.path.expanduser(source))
    if not os.path.exists(path):
        raise ConfigError(f"singularity: bind source {path} does not exist on this host")
    return path


def _container_env(cfg: SingularityConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables set in the container, as ``APPTAINERENV_*`` for the exec client."""
    src = os.environ if environ is None else environ
    host = {
        k: v
        for k, v in src.items()
        if k not in _HOST_ONLY and not k.startswith(_HOST_ONLY_PREFIXES) and _NAME_RE.match(k)
    }
    if not cfg.inherit_env:
        wanted = tuple(p.upper() for p in cfg.env_passthrough)
        host = {k: v for k, v in host.items() if any(fnmatch.fnmatchcase(k.upper(), p) for p in wanted)}
    chosen = filter_environment(host, passthrough=cfg.env_passthrough, extra_blocked=cfg.env_blocklist)
    for key in cfg.env:
        if not _NAME_RE.match(key):
            raise ConfigError(f"singularity: env name {key!r} is not a valid variable name")
        if key == "HOME":
            raise ConfigError("singularity: env may not set HOME (apptainer refuses it); use cwd for the start directory")
    chosen.update(cfg.env)
    return {f"APPTAINERENV_{k}": v for k, v in chosen.items()}


def _stop_quietly(runtime: Runtime, name: str, env: Mapping[str, str], grace: int) -> None:
    """Finalizer: the environment was dropped (or the interpreter exits) without close()."""
    try:
        stop_instance(runtime, name, env=env, grace=grace)
    except Exception as exc:  # noqa: BLE001 - nothing to report to at this point
        log.warning("singularity: could not stop instance %s: %s", name, exc)
