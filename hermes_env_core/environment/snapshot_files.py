"""Taking a snapshot, starting an environment from one, and forks.

Files per backend: local, an archive of the working tree (or of declared
paths) made here; ssh, the same made by ``tar`` on the host; docker, a commit
of the container with its workspace volume's contents folded into the image.
A backend may capture its own files instead (``BaseEnvironment.snapshot_files``
and ``start_from_snapshot``, as the singularity plugin copies its overlay).
Any other backend gets ``UnsupportedOperation`` (or a state-only snapshot,
``files=False``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import shlex
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import EnvironmentUnavailable, HermesEnvError, UnsupportedOperation, UsageError
from .session import SessionState
from .snapshot import (
    CorruptSnapshotError,
    FilesRef,
    Snapshot,
    check_name,
    filter_state,
    load_snapshot,
    new_name,
    new_workdir,
    restored_state,
    snapshots_dir,
    state_to_json,
    store,
)
from .handles import run_to_end

if TYPE_CHECKING:
    from ..factory import EnvironmentFactory
    from .base import BaseEnvironment

__all__ = ["environment_from_snapshot", "fork_environment", "remove_image", "take_snapshot"]

_log = logging.getLogger(__name__)
FILE_BACKENDS = ("local", "ssh", "docker")
CORE_KINDS = ("archive", "image", "none")
DEFAULT_MAX_BYTES = 2 << 30
_MARK = b"\x1ehermes-snapshot-archive\n"
_IMAGE_REPO = "hermes-env-snapshot"
# Options that name one target, not what it is made of: never carried to a new one.
_NOT_CARRIED = frozenset({"task_id", "persistent", "cwd"})


def _own_hook(env: BaseEnvironment) -> bool:
    """Whether ``env``'s class captures its files itself (overrides ``snapshot_files``)."""
    from .base import BaseEnvironment

    return type(env).snapshot_files is not BaseEnvironment.snapshot_files


def _unsupported(env_name: str, what: str) -> UnsupportedOperation:
    return UnsupportedOperation(
        f"backend {env_name!r} cannot {what}: snapshots of files and forks work on {', '.join(FILE_BACKENDS)} "
        "and on backends that capture their own files (snapshot_files); "
        f"on {env_name!r} take a state-only snapshot instead (env.snapshot(files=False): cwd, variables, "
        "functions, aliases and options, no files) and start a new environment from it"
    )


# -- taking one ----------------------------------------------------------------------------------
def _carried_options(env: BaseEnvironment) -> dict[str, Any]:
    """The environment's options as JSON values, without secrets and without what names its target."""
    from pydantic import SecretStr

    from ..backends.local import filter_environment

    cfg = env.config
    out = cfg.model_dump(mode="json")
    for key in list(out):
        field = type(cfg).model_fields.get(key)
        annotation = repr(field.annotation) if field is not None else ""
        if key in _NOT_CARRIED or isinstance(getattr(cfg, key, None), SecretStr) or "SecretStr" in annotation:
            out.pop(key)
    if isinstance(out.get("env"), dict):
        out["env"] = filter_environment(out["env"])
    return out


def _live_options(env: BaseEnvironment) -> dict[str, Any]:
    """The environment's options as they are (secrets included), for a fork made in this process."""
    cfg = env.config
    return {k: getattr(cfg, k) for k in type(cfg).model_fields if k not in _NOT_CARRIED}


def take_snapshot(
    env: BaseEnvironment,
    name: str | None = None,
    *,
    paths: Sequence[str] | None = None,
    files: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    _temporary: bool = False,
) -> Snapshot:
    """Capture ``env``'s session state (fresh checkpoint, secrets left out) and its files; store it."""
    if env.closed:
        raise HermesEnvError(f"{env.name}: cannot snapshot a closed environment")
    name = check_name(name) if name is not None else new_name()
    if not _temporary and (snapshots_dir() / name).exists():
        raise UsageError(f"a snapshot named {name!r} already exists; remove it first (hermes-env snapshots rm {name})")
    if files and env.name not in FILE_BACKENDS and not _own_hook(env):
        raise _unsupported(env.name, "take a snapshot of its files")
    if paths is not None and env.name == "docker":
        raise HermesEnvError("docker: a snapshot commits the whole container; paths= is for local and ssh")
    session = env.session  # a fresh checkpoint
    raw = session.state
    if raw is None:
        raise EnvironmentUnavailable(f"{env.name}: the session has no state to snapshot yet")
    cfg = env.config
    state, omitted = filter_state(
        raw, passthrough=tuple(getattr(cfg, "env_passthrough", ())), blocked=tuple(getattr(cfg, "env_blocklist", ()))
    )
    workdir = Path(tempfile.mkdtemp(prefix="hermes-env-fork-")) if _temporary else new_workdir(name)
    try:
        ref = _capture_own(env, name, workdir, paths, _temporary) if files and _own_hook(env) else None
        if ref is not None:
            pass
        elif not files:
            ref = FilesRef("none")
        elif env.name == "docker":
            ref = _capture_docker(env, name, workdir, temporary=_temporary)
        else:
            roots = tuple(paths) if paths is not None else (state.cwd or session.cwd or "",)
            ref = _capture_archives(env, roots, workdir, max_bytes)
        snap = Snapshot(
            name=name, backend=env.name, created=time.time(), state_text=state_to_json(state), files=ref,
            options=_live_options(env) if _temporary else _carried_options(env), omitted=omitted,
        )
        if _temporary:
            return dataclasses.replace(snap, path=str(workdir))
        return store(snap, workdir)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


def _capture_own(
    env: BaseEnvironment, name: str, workdir: Path, paths: Sequence[str] | None, temporary: bool
) -> FilesRef | None:
    """The backend's own capture (None: the core's archives); its record checked."""
    ref = env.snapshot_files(workdir, name, paths=paths, temporary=temporary)
    if ref is None:
        return None
    if not isinstance(ref, FilesRef) or ref.kind in CORE_KINDS or not check_kind(ref.kind):
        raise HermesEnvError(
            f"{env.name}: snapshot_files returned {ref!r}; it must be a FilesRef of the backend's own kind "
            f"(letters, digits, '_' or '-'; not {', '.join(CORE_KINDS)})"
        )
    for part in ref.parts:
        if "/" in part or part.startswith(".") or not (workdir / part).is_file():
            raise HermesEnvError(f"{env.name}: snapshot_files named part {part!r}, which is not a file it wrote in {workdir}")
    return ref


def check_kind(kind: str) -> bool:
    return isinstance(kind, str) and bool(kind) and len(kind) <= 40 and kind.replace("_", "a").replace("-", "a").isalnum()


def _check_roots(env: BaseEnvironment, roots: Sequence[str]) -> tuple[str, ...]:
    out = []
    for root in roots:
        if not isinstance(root, str) or not posixpath.isabs(root):
            raise HermesEnvError(f"{env.name}: snapshot paths must be absolute directories in the target, got {root!r}")
        root = posixpath.normpath(root)
        if root == "/":
            raise HermesEnvError(
                f"{env.name}: the working directory is /, which is not archived whole; "
                "pass paths=[...] with the directories to keep"
            )
        out.append(root)
    return tuple(out)


def _capture_archives(env: BaseEnvironment, roots: Sequence[str], workdir: Path, max_bytes: int) -> FilesRef:
    roots = _check_roots(env, roots)
    parts, size = [], 0
    for i, root in enumerate(roots):
        part = f"files-{i}.tar.gz"
        if env.name == "local":
            _archive_here(root, workdir / part, max_bytes - size)
        else:
            _archive_there(env, root, workdir / part, max_bytes - size)
        size += (workdir / part).stat().st_size
        parts.append(part)
    return FilesRef("archive", roots=roots, parts=tuple(parts), size=size)


def _archive_here(root: str, out: Path, budget: int) -> None:
    if not os.path.isdir(root):
        raise HermesEnvError(f"local: cannot archive {root}: not a directory")
    total = 0

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        nonlocal total
        if info.isdev():
            return None
        total += info.size
        if total > budget:
            raise HermesEnvError(
                f"local: {root} holds more than {budget} bytes; snapshot fewer paths (paths=[...]) "
                "or raise max_bytes"
            )
        return info

    with tarfile.open(out, "w:gz", compresslevel=1) as tar:
        tar.add(root, arcname=".", filter=keep)


def _archive_there(env: BaseEnvironment, root: str, out: Path, budget: int) -> None:
    q = shlex.quote(root)
    script = (
        f"exec 2>/dev/null; set -o pipefail; cd -- {q} || {{ printf 'no such directory\\n'; exit 3; }}; "
        f"printf '\\036hermes-snapshot-archive\\n'; "
        "if command -v gzip >/dev/null; then tar -cf - . | gzip -1; else tar -cf - .; fi"
    )
    handle = env._run_bash(script, login=False, timeout=None, stdin_data=None)  # noqa: SLF001 - the core's own
    code, data = run_to_end(handle, timeout=3600.0)
    head, sep, body = data.partition(_MARK)
    if not sep or code not in (0, 1):  # tar: 1 = a file changed while it was read
        why = {3: "not a directory", 127: "the target has no tar"}.get(code, f"exit {code}")
        raise HermesEnvError(f"{env.name}: archiving {root} failed ({why}): {head[-300:].decode(errors='replace')}")
    if len(body) > budget:
        raise HermesEnvError(f"{env.name}: {root} is over {budget} bytes archived; snapshot fewer paths (paths=[...])")
    out.write_bytes(body)


# -- docker -------------------------------------------------------------------------------------
def _docker_api(docker_host: str | None) -> Any:
    from ..backends.docker import _engine

    return _engine(docker_host)[0]


def _capture_docker(env: Any, name: str, workdir: Path, *, temporary: bool) -> FilesRef:
    """Commit the container; fold the workspace volume's files into the image (a volume is not committed)."""
    cfg = env.config
    api = _docker_api(cfg.docker_host)
    cid = env.container_id
    if not cid:
        raise EnvironmentUnavailable("docker: the environment has no container to snapshot")
    tag = f"{'fork' if temporary else name}-{os.urandom(4).hex()}"
    labels = {"hermes-env.snapshot": name, "hermes-env.kind": "fork" if temporary else "snapshot"}
    try:
        # An untagged first commit: a run that dies half-way leaves only a dangling image, never a tag.
        first = api.commit(cid, pause=False)["Id"]
        ws = cfg.workspace_path
        stream, _ = api.get_archive(cid, ws)
        data = b"".join(stream)
        # The holder's labels override what the container's image carried (a restored snapshot's name).
        holder = api.create_container(first, ["true"], labels=labels, network_disabled=True)["Id"]
        image = None
        try:
            api.put_archive(holder, posixpath.dirname(ws) or "/", data)
            image = api.commit(holder, repository=_IMAGE_REPO, tag=tag, pause=False)["Id"]
        finally:
            api.remove_container(holder, force=True)
            if image is None:
                _forget_image(api, first)
    except Exception as exc:
        if isinstance(exc, HermesEnvError):
            raise
        raise EnvironmentUnavailable(f"docker: committing the container for snapshot {name!r} failed: {exc}") from exc
    try:
        size = int(api.inspect_image(image).get("Size") or 0)
    except Exception:  # noqa: BLE001 - only the listing shows it
        size = 0
    return FilesRef("image", ref=f"{_IMAGE_REPO}:{tag}", digest=image, size=size)


def _forget_image(api: Any, image_id: str) -> None:
    try:
        api.remove_image(image_id)
    except Exception:  # noqa: BLE001 - a dangling layer at worst; the error that got here is the one to report
        pass


def remove_image(snap: Snapshot) -> None:
    """Remove a snapshot's docker image (an error naming it when the engine refuses)."""
    ref = snap.files.ref
    if not ref:
        return
    api = _docker_api(snap.options.get("docker_host"))
    import docker

    try:
        api.remove_image(ref)
    except docker.errors.ImageNotFound:
        pass
    except docker.errors.APIError as exc:
        raise HermesEnvError(f"docker: cannot remove image {ref} of snapshot {snap.name!r}: {exc.explanation or exc}") from exc


def _check_image(snap: Snapshot, options: Mapping[str, Any]) -> None:
    import docker

    api = _docker_api(options.get("docker_host"))
    try:
        got = api.inspect_image(snap.files.ref)["Id"]
    except docker.errors.ImageNotFound:
        raise CorruptSnapshotError(
            f"snapshot {snap.name!r}: its docker image {snap.files.ref} is gone; refused "
            f"(remove the snapshot: hermes-env snapshots rm {snap.name})"
        ) from None
    if got != snap.files.digest:
        raise CorruptSnapshotError(
            f"snapshot {snap.name!r}: image {snap.files.ref} is {got[:19]}, not the {str(snap.files.digest)[:19]} "
            "that was committed; refused"
        )


# -- starting from one ------------------------------------------------------------------------------
def _map(path: str | None, dirs: Mapping[str, str]) -> str | None:
    if path is None:
        return None
    for root, new in dirs.items():
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return new + path[len(root):]
    return None


def _dest_dirs(roots: Sequence[str], base: str) -> dict[str, str]:
    if len(roots) == 1:
        return {roots[0]: base}
    out: dict[str, str] = {}
    for i, root in enumerate(roots):
        out[root] = posixpath.join(base, f"{i}-{posixpath.basename(root) or 'root'}")
    return out


def environment_from_snapshot(
    factory: EnvironmentFactory,
    backend: str | None,
    snapshot: Snapshot | str,
    options: dict[str, Any],
    *,
    restore_to: str | None = None,
) -> BaseEnvironment:
    """A new environment whose session starts from ``snapshot``: files first, then the state,
    restored into its session server before the first command."""
    snap = load_snapshot(snapshot)
    opts = {**snap.options, **options}
    if backend is not None and backend != snap.backend:
        if snap.files.kind != "none":
            raise UsageError(
                f"snapshot {snap.name!r} was taken on backend {snap.backend!r} with its files; it starts "
                f"environments on {snap.backend!r} only, not {backend!r} (a state-only snapshot, "
                "env.snapshot(files=False), starts on any backend)"
            )
        # The state alone, on another backend: that backend's options, none of the snapshot's.
        snap, opts = dataclasses.replace(snap, backend=backend), dict(options)
    kind = snap.files.kind
    fresh: str | None = None
    dirs: dict[str, str] = {}
    if kind == "image":
        _check_image(snap, opts)
        opts.update(image=snap.files.ref, pull="never")
        if "workspace" not in options:  # the workspace's files are in the image: a new volume gets them
            opts.update(workspace="ephemeral", workspace_source=None)
    elif kind not in CORE_KINDS:
        return _from_own(factory, snap, opts)
    elif kind == "archive" and snap.backend == "local":
        base, fresh = _local_dest(restore_to)
        dirs = _dest_dirs(snap.files.roots, base)
        try:
            for root, part in zip(snap.files.roots, snap.files.parts):
                os.makedirs(dirs[root], exist_ok=True)
                with tarfile.open(snap.part(part), "r:*") as tar:
                    tar.extractall(dirs[root], filter="tar")
        except BaseException:
            if fresh:
                shutil.rmtree(fresh, ignore_errors=True)
            raise
    state0 = snap.state
    cwd = _map(state0.cwd, dirs) if dirs else None
    if cwd is not None:
        opts["cwd"] = cwd
    try:
        env = factory.create(snap.backend, **opts)
    except BaseException:
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)
        raise
    try:
        if kind == "archive" and snap.backend != "local":
            base, fresh = _remote_dest(env, restore_to)
            dirs = _dest_dirs(snap.files.roots, base)
            for root, part in zip(snap.files.roots, snap.files.parts):
                _unpack_there(env, snap.part(part), dirs[root])
            cwd = _map(state0.cwd, dirs)
        if fresh:
            _remove_at_close(env, fresh)
        if dirs:
            where = ", ".join(f"{r} -> {d}" for r, d in dirs.items())
            env._note(f"started from snapshot {snap.name!r}: its files were restored into {where}")  # noqa: SLF001
        _start_from(env, snap, state0, cwd, dirs)
    except BaseException:
        env.close()
        raise
    return env


def _from_own(factory: EnvironmentFactory, snap: Snapshot, opts: dict[str, Any]) -> BaseEnvironment:
    """A snapshot of a backend's own kind: the backend makes the environment with the files
    (``start_from_snapshot``), the core restores the state, moved with the files if they moved."""
    moved: dict[str, str] = {}

    def create(*, moved_dirs: Mapping[str, str] | None = None, **options: Any) -> BaseEnvironment:
        moved.update(moved_dirs or {})
        cwd = _map(snap.state.cwd, moved) if moved else None
        if cwd is not None:
            options["cwd"] = cwd
        return factory.create(snap.backend, **options)

    env = factory.registry.load(snap.backend).start_from_snapshot(snap, opts, create)
    try:
        state = snap.state
        _start_from(env, snap, state, _map(state.cwd, moved) if moved else None, moved)
    except BaseException:
        env.close()
        raise
    return env


def _local_dest(restore_to: str | None) -> tuple[str, str | None]:
    if restore_to is None:
        path = tempfile.mkdtemp(prefix="hermes-env-restore-")
        return path, path
    path = os.path.abspath(restore_to)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UsageError(f"restore_to={restore_to!r} must be a new or empty directory")
    os.makedirs(path, exist_ok=True)
    return path, None


def _remote_dest(env: BaseEnvironment, restore_to: str | None) -> tuple[str, str | None]:
    if restore_to is None:
        script = 'd=$(mktemp -d "${TMPDIR:-/tmp}/hermes-env-restore-XXXXXXXX") && printf "\\036dir %s\\n" "$d"'
    else:
        q = shlex.quote(restore_to)
        script = (
            f'mkdir -p -- {q} && cd -- {q} && [ -z "$(ls -A)" ] && printf "\\036dir %s\\n" "$PWD" '
            f'|| {{ printf "restore_to must be a new or empty directory\\n"; exit 4; }}'
        )
    code, out = run_to_end(env._run_bash(script, login=False, timeout=60.0, stdin_data=None), timeout=60.0)  # noqa: SLF001
    text = out.decode("utf-8", "surrogateescape")
    if code != 0 or "\x1edir " not in text:
        raise HermesEnvError(f"{env.name}: cannot make a directory to restore the snapshot into: {text.strip()[-300:]}")
    path = text.split("\x1edir ", 1)[1].split("\n", 1)[0]
    return path, path if restore_to is None else None


def _unpack_there(env: BaseEnvironment, archive: Path, dest: str) -> None:
    data = archive.read_bytes()
    unzip = "gzip -dc | " if data[:2] == b"\x1f\x8b" else ""
    q = shlex.quote(dest)
    script = f"set -o pipefail; mkdir -p -- {q} && cd -- {q} && {unzip}tar -xf - 2>&1"
    code, out = run_to_end(env._run_bash(script, login=False, timeout=None, stdin_data=data), timeout=3600.0)  # noqa: SLF001
    if code != 0:
        raise HermesEnvError(f"{env.name}: unpacking the snapshot into {dest} failed (exit {code}): {out[-300:]!r}")


def _remove_at_close(env: BaseEnvironment, path: str) -> None:
    """The fresh directory goes with the environment, as a container's files go with it."""
    inner = env.cleanup
    local = env.name == "local"

    def cleanup(*args: Any, **kwargs: Any) -> None:
        if not local:
            try:
                run_to_end(env._run_bash(f"rm -rf -- {shlex.quote(path)}", login=False, timeout=60.0, stdin_data=None), timeout=60.0)  # noqa: SLF001
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                _log.debug("%s: could not remove %s: %r", env.name, path, exc)
        try:
            inner(*args, **kwargs)
        finally:
            if local:
                shutil.rmtree(path, ignore_errors=True)

    env.cleanup = cleanup  # type: ignore[method-assign]


def _start_from(env: BaseEnvironment, snap: Snapshot, state: SessionState, cwd: str | None, dirs: Mapping[str, str]) -> None:
    cfg = env.config
    passthrough = tuple(getattr(cfg, "env_passthrough", ()))
    blocked = tuple(getattr(cfg, "env_blocklist", ()))
    def start(baseline: SessionState) -> SessionState:
        return restored_state(
            state, baseline, cwd=cwd, passthrough=passthrough, blocked=blocked,
            relocate=(lambda p: _map(p, dirs)) if dirs else None,
        )

    if env.session_mode == "server":
        env._server_runner().start_from = start  # noqa: SLF001 - the core's own hook
    else:
        session = env.session
        assert session.baseline is not None
        session.set_state(start(session.baseline))


# -- forks ------------------------------------------------------------------------------------------
def fork_environment(env: BaseEnvironment, n: int, *, paths: Sequence[str] | None = None) -> list[BaseEnvironment]:
    """``n`` new environments, each its own target, with ``env``'s state and files (see ``snapshot``)."""
    from ..factory import EnvironmentFactory

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fork(n): n must be a whole number >= 1, got {n!r}")
    if env.name not in FILE_BACKENDS and not _own_hook(env):
        raise _unsupported(env.name, "fork")
    snap = take_snapshot(env, f"fork-{os.urandom(4).hex()}", paths=paths, _temporary=True)
    factory = EnvironmentFactory()
    made: list[BaseEnvironment] = []
    lock = threading.Lock()

    def one(_: int) -> BaseEnvironment:
        new = environment_from_snapshot(factory, env.name, snap, {})
        with lock:
            made.append(new)
        new.session  # boot it now: the fork is ready when it is returned  # noqa: B018
        return new

    try:
        with ThreadPoolExecutor(max_workers=min(n, 8)) as pool:
            forks = list(pool.map(one, range(n)))
    except BaseException:
        for e in made:
            try:
                e.close()
            except Exception:  # noqa: BLE001
                pass
        if snap.files.kind == "image":
            _release_image(snap)
        raise
    finally:
        if snap.path:
            shutil.rmtree(snap.path, ignore_errors=True)
    if snap.files.kind == "image":
        # The image goes with the last fork that uses it.
        for e in forks:
            _untag_after(e, snap)
    return forks


def _release_image(snap: Snapshot) -> None:
    try:
        remove_image(snap)
    except HermesEnvError as exc:
        _log.debug("fork image %s not removed yet: %s", snap.files.ref, exc)


def _untag_after(env: BaseEnvironment, snap: Snapshot) -> None:
    inner = env.cleanup

    def cleanup(*args: Any, **kwargs: Any) -> None:
        try:
            inner(*args, **kwargs)
        finally:
            _release_image(snap)

    env.cleanup = cleanup  # type: ignore[method-assign]

