"""The Docker backend: one long-lived, hardened container per environment.

Each command is an Engine API exec of ``bash -c``; the ``docker`` SDK is imported
only when an environment is created (``pip install 'hermes-env-core[docker]'``).
"""

from __future__ import annotations

import os
import posixpath
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from ..environment.base import BaseEnvironment
from ..environment.channel import ChannelStream
from ..environment.handles import ProcessHandle
from ..environment.options import EnvironmentConfig
from ..environment.result import Usage
from ..environment.session import WrappedCommand
from ..errors import BackendError, EnvironmentUnavailable
from . import _docker_reaper as reaper
from ..config import memory_bytes
from ._docker_config import DEFAULT_CAPABILITIES, DockerConfig, parse_size
from ._docker_exec import MARKER_VAR, ExecHandle, ExecStream
from ._tree_script import TREE_DONE, parse_tree_output, tree_script

__all__ = ["DEFAULT_CAPABILITIES", "DockerConfig", "DockerEnvironment", "parse_size", "reap_orphans"]

INSTALL_HINT = "pip install 'hermes-env-core[docker]'"
_DEFAULT_SOCKET = "unix:///var/run/docker.sock"

_SCRIPT_ARG_LIMIT = 100_000  # one argv string may not exceed 128 KiB on Linux
_PID1 = ["sleep", "infinity"]  # under docker-init (init=True), which reaps zombies
# A script too long for argv, written into the container first, read back by
# a process substitution that also deletes it; `set --` keeps $@ empty.
# The memory cgroup's OOM-kill count, as the container sees it (cgroup v2, else v1).
_OOM_COUNT = (
    "for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do "
    '[[ -r $f ]] || continue; while read -r k v; do [[ $k == oom_kill ]] && { echo "$v"; exit 0; }; done <"$f"; '
    "done; exit 1"
)
_SOURCE_FILE = '__hermes_src=$1; set --; builtin source <(cat -- "$__hermes_src"; rm -f -- "$__hermes_src")'


# -- the SDK and the engine --------------------------------------------------------------
def _sdk() -> Any:
    try:
        import docker
    except ImportError as exc:
        raise EnvironmentUnavailable(f"docker backend needs the docker SDK, which is not installed: {INSTALL_HINT}") from exc
    return docker


_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def _engine(docker_host: str | None) -> tuple[Any, str]:
    """A connected low-level client, shared per engine URL, and that URL's description."""
    docker = _sdk()
    if docker_host:
        url, where = docker_host, "from the docker_host option"
    elif os.environ.get("DOCKER_HOST"):
        url, where = os.environ["DOCKER_HOST"], "from DOCKER_HOST"
    else:
        url, where = _DEFAULT_SOCKET, "the default socket; DOCKER_HOST is not set"
    desc = f"{url} ({where})"
    with _clients_lock:
        api = _clients.get(url)
        if api is not None:
            return api, desc
        kwargs = docker.utils.kwargs_from_env()
        kwargs["base_url"] = url
        try:
            api = docker.APIClient(version="auto", timeout=120, **kwargs)
        except Exception as exc:  # DockerException, requests errors
            raise EnvironmentUnavailable(
                f"docker: cannot reach the Docker engine at {desc}: {exc}; "
                "start dockerd, or point docker_host / DOCKER_HOST at a running engine"
            ) from exc
        _clients[url] = api
        return api, desc


def reap_orphans(docker_host: str | None = None) -> list[str]:
    """Remove orphaned hermes-env containers now; returns their names."""
    api, _ = _engine(docker_host)
    return reaper.reap_orphans(api)


def _remove_quietly(api: Any, box: dict[str, str | None]) -> None:
    cid = box.get("id")
    if cid:
        try:
            api.remove_container(cid, force=True, v=True)
        except Exception:  # noqa: BLE001 - at exit, or already gone
            pass


class DockerEnvironment(BaseEnvironment):
    """Runs commands in one long-lived Docker container."""

    name: ClassVar[str] = "docker"
    named_sessions = True  # a session server that outlives this process (environment.named)
    stdin_mode: ClassVar[Literal["pipe"]] = "pipe"
    records_pid: ClassVar[bool] = False  # the tree is found by a marker in the exec's environment
    config_model: ClassVar[type[EnvironmentConfig]] = DockerConfig
    #: What keeps the container after close, for a detached background process (found again by task id).
    background_options: ClassVar[dict[str, Any]] = {"persistent": True}

    def __init__(self, config: DockerConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.config: DockerConfig
        cfg = self.config
        self._docker = _sdk()
        self._api, self._host = _engine(cfg.docker_host)
        self._lock = threading.Lock()
        self._gen = 0
        self._box: dict[str, str | None] = {"id": None}
        self._events_seen_ns = 0  # engine events up to this time were already given to a command
        self._events_floor_s = 0.0  # the last command's end: engine events before it are not the next one's
        self._oom_kills: int | None = None  # the container's OOM-kill counter at the last look (None: not known)
        self._user = cfg.user or ""
        self._exec_env = [f"{k}={v}" for k, v in cfg.env.items()]
        self.container_name = reaper.container_name(self.task_id, persistent=cfg.persistent)
        reaper.mark_in_use(self.container_name, True)
        reaper.reap_once(self._api, self._host)
        self._finalizer = None if cfg.persistent else weakref.finalize(self, _remove_quietly, self._api, self._box)
        try:
            self._attach()
        except BaseException:
            reaper.mark_in_use(self.container_name, False)
            raise

    # -- public -----------------------------------------------------------------------
    @classmethod
    def target_exists(cls, config: DockerConfig) -> bool:
        """Whether the persistent container of ``config.task_id`` exists, asked without creating anything."""
        if not (config.persistent and config.task_id):
            return False
        docker = _sdk()
        api, host = _engine(config.docker_host)
        try:
            api.inspect_container(reaper.container_name(config.task_id, persistent=True))
            return True
        except docker.errors.NotFound:
            return False
        except Exception as exc:
            raise EnvironmentUnavailable(f"docker: cannot reach the Docker engine at {host}: {exc}") from exc

    @property
    def container_id(self) -> str | None:
        return self._box["id"]

    @classmethod
    def check_requirements(cls) -> list[str]:
        """Problems that stop this backend here (empty when it can run), for ``hermes-env doctor``."""
        try:
            api, desc = _engine(None)
            api.ping()
        except EnvironmentUnavailable as exc:
            return [str(exc)]
        except Exception as exc:  # noqa: BLE001
            return [f"docker: the engine at {desc} does not answer: {exc}"]
        return []

    def cleanup(self, force: bool = False) -> None:
        """Remove the container; a persistent one only when ``force``."""
        reaper.mark_in_use(self.container_name, False)
        if self.config.persistent and not force:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        cid, self._box["id"] = self._box["id"], None
        if cid:
            try:
                self._api.remove_container(cid, force=True, v=True)
            except self._docker.errors.NotFound:
                pass
            except Exception as exc:
                raise self._error("remove the container", exc) from exc

    # -- the container ----------------------------------------------------------------
    def _error(self, doing: str, exc: BaseException) -> EnvironmentUnavailable:
        errors = self._docker.errors
        if isinstance(exc, errors.APIError):
            return EnvironmentUnavailable(f"docker: cannot {doing} on {self._host}: {exc.explanation or exc}")
        return EnvironmentUnavailable(f"docker: cannot reach the Docker engine at {self._host} to {doing}: {exc}")

    def _inspect(self, ref: str) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = self._api.inspect_container(ref)
            return info
        except self._docker.errors.NotFound:
            return None
        except Exception as exc:
            raise self._error("inspect the container", exc) from exc

    def _attach(self) -> None:
        """Reuse the persistent container of this task id, else create one."""
        for _ in range(3):
            info = self._inspect(self.container_name) if self.config.persistent else None
            if info is None:
                try:
                    self._box["id"] = self._create(self.container_name)
                    return
                except _NameTaken:
                    continue  # another process created it just now: reuse it
            labels = info["Config"].get("Labels") or {}
            if labels.get(reaper.LABEL_TASK) != self.task_id:
                raise EnvironmentUnavailable(
                    f"docker: container name {self.container_name!r} is taken by a container that is not "
                    f"hermes-env task {self.task_id!r}; remove it or use another task_id"
                )
            self._box["id"] = info["Id"]
            if not self._revive(info):
                self._box["id"] = self._create()
                return
            note = f"reusing persistent container {self.container_name} (shell state starts fresh, files are kept)"
            if labels.get(reaper.LABEL_CONFIG) != self.config.container_hash():
                note += "; it was created with other options, cleanup(force=True) to recreate it"
            self._note(note)
            return
        raise EnvironmentUnavailable(f"docker: could not create or reuse container {self.container_name!r}")

    def _revive(self, info: dict[str, Any]) -> bool:
        """Get an existing container running; False when it must be replaced."""
        status = info["State"].get("Status")
        try:
            if status == "running":
                return True
            if status == "paused":
                self._api.unpause(info["Id"])
                return True
            if status == "exited":
                self._api.start(info["Id"])
                return True
            self._api.remove_container(info["Id"], force=True, v=True)  # created, dead
            return False
        except self._docker.errors.NotFound:
            return False
        except Exception as exc:
            raise self._error(f"start container {self.container_name}", exc) from exc

    def _ensure_image(self) -> None:
        cfg, errors = self.config, self._docker.errors
        try:
            if cfg.pull != "always":
                try:
                    self._api.inspect_image(cfg.image)
                    return
                except errors.ImageNotFound:
                    if cfg.pull == "never":
                        raise EnvironmentUnavailable(
                            f"docker: image {cfg.image!r} not found on {self._host}; build or pull it "
                            f"(docker pull {cfg.image}), or set pull='missing'"
                        ) from None
            self._api.pull(cfg.image)
        except errors.APIError as exc:
            raise EnvironmentUnavailable(
                f"docker: image {cfg.image!r} is not on {self._host} and pulling it failed: {exc.explanation or exc}"
            ) from exc
        except EnvironmentUnavailable:
            raise
        except Exception as exc:
            raise self._error(f"find image {cfg.image!r}", exc) from exc

    def _host_config(self) -> dict[str, Any]:
        cfg, types = self.config, self._docker.types
        mounts = []
        ws = cfg.workspace_path
        if cfg.workspace == "bind":
            mounts.append(types.Mount(ws, cfg.workspace_source, type="bind", read_only=cfg.workspace_read_only))
        else:  # a named or an anonymous volume (removed with the container)
            mounts.append(types.Mount(ws, cfg.workspace_source, type="volume", read_only=cfg.workspace_read_only))
        for name, spec in cfg.volumes.items():
            path, _, mode = spec.partition(":")
            mounts.append(types.Mount(path, name, type="volume", read_only=mode == "ro"))
        flags = "noexec" if cfg.tmpfs_noexec else "exec"
        tmpfs = {
            path: f"rw,{flags},nosuid,nodev,size={parse_size(size)},mode={'755' if path == '/run' else '1777'}"
            for path, size in cfg.tmpfs.items()
        }
        memory = memory_bytes(cfg.memory) if cfg.memory else None
        return self._api.create_host_config(  # type: ignore[no-any-return]
            cap_drop=["ALL"],
            cap_add=list(cfg.cap_add) or None,
            security_opt=(["no-new-privileges"] if cfg.no_new_privileges else []) + list(cfg.security_opt) or None,
            pids_limit=cfg.pids_limit,
            mem_limit=memory,
            memswap_limit=memory,
            nano_cpus=int(cfg.cpu * 1e9) if cfg.cpu else None,
            read_only=cfg.read_only_root,
            tmpfs=tmpfs or None,
            network_mode=cfg.network_mode,
            mounts=mounts,
            init=True,
        )

    def _create(self, name: str | None = None) -> str:
        """Create and start a container; on failure nothing is left behind."""
        cfg, errors = self.config, self._docker.errors
        self._ensure_image()
        if name is None:
            name = self.container_name if cfg.persistent else reaper.container_name(self.task_id, persistent=False)
        labels = reaper.labels_for(
            self.task_id, persistent=cfg.persistent, idle_lifetime_s=cfg.idle_lifetime_s, config_hash=cfg.container_hash()
        )
        try:
            cid: str = self._api.create_container(
                # The user applies per exec: an exec as root in a container
                # whose user is not root gets no capabilities (_prepare needs them).
                cfg.image, _PID1, name=name, labels=labels,
                working_dir=cfg.workdir or cfg.workspace_path, host_config=self._host_config(), detach=True,
            )["Id"]
        except errors.APIError as exc:
            if exc.status_code == 409 and cfg.persistent:
                raise _NameTaken() from exc
            raise self._error(f"create a container from {cfg.image!r}", exc) from exc
        except Exception as exc:
            raise self._error(f"create a container from {cfg.image!r}", exc) from exc
        try:
            self._api.start(cid)
            self._prepare(cid)
        except BaseException as exc:
            try:
                self._api.remove_container(cid, force=True, v=True)
            except Exception:  # noqa: BLE001 - the reaper gets it (owner-pid label)
                pass
            if isinstance(exc, EnvironmentUnavailable):
                raise
            if isinstance(exc, Exception):
                raise self._error(f"start a container from {cfg.image!r}", exc) from exc
            raise
        self._oom_kills = 0  # a new container's memory cgroup has killed nothing yet
        if name != self.container_name:
            reaper.mark_in_use(self.container_name, False)
            self.container_name = name
            reaper.mark_in_use(name, True)
        return cid

    def _prepare(self, cid: str) -> None:
        """Check the user exists; give it its fresh workspace (volumes start owned by root)."""
        user = self._user
        if not user or user.split(":")[0] in ("0", "root"):
            return
        if self.config.workspace == "bind":
            cmd, as_user = ["bash", "-c", "exit 0"], user
        else:
            script = '[[ -O $1 ]] && { chown -- "$2" "$1" || exit 1; }; exit 0'
            cmd, as_user = ["bash", "-c", script, "bash", self.config.workspace_path, user], "0"
        code, out = self._exec_simple(cmd, cid=cid, user=as_user)
        if code != 0:
            raise EnvironmentUnavailable(
                f"docker: cannot run commands as user {user!r} in {self.config.image!r}: "
                f"{out.decode(errors='replace').strip() or f'exit {code}'}"
            )

    def _recover(self, gen: int, why: str) -> None:
        """The container is not there to run commands: get one back, and say so."""
        with self._lock:
            if gen != self._gen:
                return  # another thread did it
            old = self.container_name
            self._oom_kills = None  # a restarted container counts from 0 again
            info = self._inspect(self._box["id"] or old)
            if info is not None and self._revive(info):
                state = info["State"]
                detail = f"exit code {state.get('ExitCode')}" + (", OOM-killed" if state.get("OOMKilled") else "")
                self._note(
                    f"environment recreated: container {old} {why} ({detail}); started it again. Its processes "
                    "and tmpfs contents (/tmp) are gone, its other files are kept; shell state was restored."
                )
            else:
                self._box["id"] = self._create()
                self._note(
                    f"environment recreated: container {old} {why}; created {self.container_name} from "
                    f"{self.config.image}. Files written before are gone; shell state was restored."
                )
            self._gen += 1

    # -- execs ------------------------------------------------------------------------
    def _exec_create(self, cmd: list[str], *, stdin: bool, env: list[str], user: str | None = None,
                     cid: str | None = None) -> str:
        errors = self._docker.errors
        for attempt in range(2):
            target, gen = cid or self._box["id"], self._gen
            try:
                created: dict[str, str] = self._api.exec_create(
                    target, cmd, stdin=stdin, environment=env, user=self._user if user is None else user
                )
                return created["Id"]
            except errors.NotFound:
                why = "was removed"
            except errors.APIError as exc:
                if exc.status_code != 409:
                    raise self._error("start a command", exc) from exc
                why = "was not running"
            except Exception as exc:
                raise self._error("start a command", exc) from exc
            if cid is not None or attempt:
                raise EnvironmentUnavailable(f"docker: container {self.container_name} {why} and could not be brought back")
            self._recover(gen, why)
        raise AssertionError("unreachable")

    def _start(self, cmd: list[str], stdin_data: bytes | None, *, env: list[str] | None = None,
               user: str | None = None, cid: str | None = None, nonce: str | None = None) -> ExecHandle:
        exec_id = self._exec_create(cmd, stdin=stdin_data is not None, env=env or self._exec_env, user=user, cid=cid)
        try:
            # Only commands (they carry a nonce) get the OOM and container-death checks.
            handle = ExecHandle(self._api, exec_id, stdin_data=stdin_data, on_exit=self._after_exec if nonce else None)
        except Exception as exc:
            raise self._error("attach to a command", exc) from exc
        handle.nonce = nonce  # type: ignore[attr-defined]
        handle.seen = set()  # type: ignore[attr-defined]  # pid:starttime of the command's processes
        handle._killer = lambda graceful: self._signal_tree(handle, graceful)
        return handle

    def _exec_simple(self, cmd: list[str], *, stdin: bytes | None = None, user: str | None = None,
                     cid: str | None = None) -> tuple[int, bytes]:
        """Run a helper command to its end; (exit code, merged output)."""
        handle = self._start(cmd, stdin, user=user, cid=cid)
        assert handle.stdout is not None
        chunks = []
        with handle.stdout:
            while chunk := handle.stdout.read(65536):
                chunks.append(chunk)
        return handle.wait(timeout=30.0), b"".join(chunks)

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        argv = ["bash", "-l"] if login else ["bash"]
        nonce = os.urandom(8).hex()
        env = [*self._exec_env, f"{MARKER_VAR}={nonce}"]
        data = script.encode("utf-8", "surrogateescape")
        if len(data) <= _SCRIPT_ARG_LIMIT:
            return self._start([*argv, "-c", script, "bash"], stdin_data, env=env, nonce=nonce)
        if stdin_data is None:
            # bash reads a sourced pipe to EOF before running it; the command then sees EOF on stdin.
            return self._start([*argv, "-c", "builtin source /dev/stdin", "bash"], data, env=env, nonce=nonce)
        path = posixpath.join(self._state_dir(), f".hermes-{self.task_id}-{nonce}.script")
        code, out = self._exec_simple(["bash", "-c", 'umask 077 && cat >"$1"', "bash", path], stdin=data)
        if code != 0:
            raise BackendError(f"docker: cannot write the command script to {path}: {out.decode(errors='replace').strip()}")
        return self._start([*argv, "-c", _SOURCE_FILE, "bash", path], stdin_data, env=env, nonce=nonce)

    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        # One exec with stdin attached; _exec_create brings a lost container back (with a note).
        exec_id = self._exec_create(list(argv), stdin=True, env=self._exec_env)
        try:
            return ExecStream(self._api.exec_start(exec_id, socket=True))
        except Exception as exc:
            raise self._error("open a channel", exc) from exc

    def _channel_command_exited(self, handle: Any, code: int) -> None:
        cpu = handle.usage  # what the server measured; the engine adds whether the OOM killer struck
        self._after_exec(handle, code)
        if handle.usage is not cpu and cpu is not None:
            handle.usage = handle.usage.merged(cpu)

    def _kill_tree(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        if isinstance(handle, ExecHandle):
            handle.killed = True
            self._signal_tree(handle, graceful)
        else:
            super()._kill_tree(handle, wrapped, graceful=graceful)

    def _tree_alive(self, handle: ProcessHandle, wrapped: WrappedCommand) -> bool | None:
        if not isinstance(handle, ExecHandle) or getattr(handle, "nonce", None) is None:
            return None
        found = self._tree_exec(handle, "0")
        return None if found is None else bool(found)

    def _signal_tree(self, handle: ExecHandle, graceful: bool) -> None:
        """Signal the command's processes inside the container, from a second exec."""
        self._tree_exec(handle, "TERM" if graceful else "KILL")

    def _tree_exec(self, handle: ExecHandle, sig: str) -> set[str] | None:
        """Run the tree script for ``handle``'s command; the processes it found
        (None when the script could not run).

        They are the processes carrying the exec's marker, plus those an earlier
        call found (a process that cleared its environment but was seen before)."""
        nonce = getattr(handle, "nonce", None)
        if nonce is None:
            return None
        seen: set[str] = getattr(handle, "seen", set())
        script = tree_script(sig, None, marker=f"{MARKER_VAR}={nonce}", known=seen)
        out = b""
        for attempt in range(4):
            if attempt == 3:
                out = self._with_spare_pids(lambda: self._kill_exec(script))
            else:
                out = self._kill_exec(script)
            if TREE_DONE.encode() in out or not out.startswith(b"OCI runtime exec failed"):
                break
            time.sleep(0.05 * (attempt + 1))  # no pid free for the helper yet
        if TREE_DONE.encode() not in out:
            return None
        found = parse_tree_output(out)
        seen |= found
        handle.seen = seen  # type: ignore[attr-defined]
        return found

    def _kill_exec(self, script: str) -> bytes:
        # Under a full pids limit the helper's own exit can take seconds to be
        # reported, so it is left to finish once it says the signals are sent.
        try:
            helper = self._start(["bash", "-c", script], None)
        except EnvironmentUnavailable:
            return b""  # the container is gone; so is the tree
        try:
            return helper.read_until(TREE_DONE.encode(), timeout=15.0)
        finally:
            helper.abandon()

    def _with_spare_pids(self, fn: Callable[[], bytes]) -> bytes:
        """Run ``fn`` with the pids limit raised a little, for a helper exec."""
        limit, cid = self.config.pids_limit, self._box["id"]
        if not limit or not cid:
            return fn()
        url = self._api._url("/containers/{0}/update", cid)
        try:
            self._api._post_json(url, data={"PidsLimit": limit + 16})
        except Exception:  # noqa: BLE001 - try without
            return fn()
        try:
            return fn()
        finally:
            try:
                self._api._post_json(url, data={"PidsLimit": limit})
            except Exception:  # noqa: BLE001
                pass

    def _command_usage(self, exit_code: int | None, started: float) -> Usage | None:
        # A command killed by SIGKILL: was it the container's memory limit?
        if exit_code != 137:
            self._events_floor_s = max(self._events_floor_s, time.time())
            return None
        oom, _ = self._oom_struck(started)
        if oom:
            self._note_oom()
        return Usage(oom_killed=oom)

    def _oom_message(self) -> str:
        limit = self.config.memory or "the host's memory"
        return f"the command was killed by the OOM killer: the container's memory limit ({limit}) was hit"

    def _note_oom(self) -> None:
        self._note(self._oom_message())

    def _oom_struck(self, started: float, also: tuple[str, ...] = ()) -> tuple[bool, set[str]]:
        """Whether the OOM killer struck in the command started at ``started``, and
        which of the engine events ``also`` happened since then.

        The engine's "oom" events may trail the kill, and one kill may bring
        several, so a late one could be taken for the next command's. The
        container's own OOM-kill counter, read at each look, rules that out: when
        it has not moved since the last look (before this command), nothing was
        killed. An event in the command's time says it was this command's."""
        before, now = self._oom_kills, self._oom_count()
        self._oom_kills = now
        quiet = now is not None and before is not None and now <= before
        kinds = also if quiet else ("oom", *also)
        seen: set[str] = set()
        ended = time.time()
        try:
            for attempt in range(4 if kinds else 0):  # events may trail the exit by a few milliseconds
                seen = self._events_since(started, kinds)
                if seen:
                    break
                time.sleep(0.05 * (attempt + 1))
        finally:
            # What happened before this command ended is this command's: never the next one's.
            self._events_floor_s = max(self._events_floor_s, ended)
        return "oom" in seen, seen & set(also)

    def _oom_count(self) -> int | None:
        """The container's memory cgroup OOM-kill count (v2 or v1), None when it cannot be read."""
        cid = self._box["id"]
        try:  # with the container's id: a gone container is not brought back for this
            code, out = self._exec_simple(["bash", "-c", _OOM_COUNT], cid=cid) if cid else (1, b"")
        except (EnvironmentUnavailable, TimeoutError):
            return None
        text = out.decode(errors="replace").strip()
        return int(text) if code == 0 and text.isdigit() else None

    def _control_first(self) -> bool:
        return bool(getattr(self.config, "pids_limit", None))

    def _explain_lost(self, started: float) -> tuple[int, str] | None:
        if not self._oom_struck(started)[0]:
            return None
        return 137, self._oom_message()

    def _after_exec(self, handle: ExecHandle, code: int) -> None:
        """Sweep up after a kill; on SIGKILL, tell a dead container from the memory limit."""
        if handle.killed:
            # bash is gone; whatever is left of its tree goes too.
            if getattr(handle, "seen", None):
                self._signal_tree(handle, False)
            return
        if code not in (137, -1):
            return
        cid = self._box["id"]
        oom, died = self._oom_struck(handle.started, ("kill", "die", "destroy"))
        info = self._inspect(cid) if cid else None
        if died or info is None or not info["State"].get("Running"):
            state = "removed" if info is None else f"exit code {info['State'].get('ExitCode')}"
            raise BackendError(f"docker: container {self.container_name} stopped while the command ran ({state})")
        # The container's memory cgroup says whether the kernel's OOM killer did it.
        handle.usage = Usage(oom_killed=oom)  # type: ignore[attr-defined]
        if oom:
            self._note_oom()

    def _events_since(self, since: float, kinds: tuple[str, ...]) -> set[str]:
        """Which of ``kinds`` the engine reported for our container since ``since``."""
        try:
            events = self._api.events(
                since=int(since) - 1, until=time.time(), decode=True,
                filters={"event": list(kinds), "container": self._box["id"]},
            )
            # An event counts for one command only: the next command, started
            # within the tolerance, must not see its predecessor's OOM.
            floor = max(since - 0.5, self._events_floor_s)
            fresh = [e for e in events if e.get("timeNano", 0) / 1e9 >= floor
                     and e.get("timeNano", 0) > self._events_seen_ns]
            if fresh:
                self._events_seen_ns = max(e.get("timeNano", 0) for e in fresh)
            return {e.get("status") or e.get("Action") for e in fresh}
        except Exception:  # noqa: BLE001 - only the diagnosis depends on it
            return set()


class _NameTaken(Exception):
    """A container with the persistent name appeared between lookup and create."""
