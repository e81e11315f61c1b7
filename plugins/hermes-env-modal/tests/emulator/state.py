"""Emulator state: apps, images, sandboxes — each sandbox a real directory plus real processes.

Path model: processes run on this host, so absolute paths are host paths. The sandbox's
``workdir`` (e.g. ``/workspace``) is mapped onto its private directory (``root``): the
entrypoint and every exec start there, and an exec ``workdir`` at or under that prefix is
translated into ``root``. With no workdir (or ``/``), execs start in ``root`` and absolute
exec workdirs are used as they are. A sandbox made from a filesystem snapshot sees its
directory at the snapshotted sandbox's path (``view``), bound there in a private mount
namespace, so paths recorded before the snapshot still hold in it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import shutil
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from modal_proto import api_pb2

from .processes import LocalProcess

GENERIC = api_pb2.GenericResult

FS_TOOLS_PATH = "/__modal/.bin/modal-sandbox-fs-tools"


def new_id(prefix: str, suffix: str = "") -> str:
    # 'emu' + 20 hex chars: never the 22-char base62 shape the client treats as a V1 sandbox id.
    return f"{prefix}-emu{secrets.token_hex(10)}{suffix}"


@dataclass
class AppRecord:
    id: str
    name: str
    environment: str


@dataclass
class ImageRecord:
    id: str
    kind: str  # "built" (any registry/dockerfile image: instantly "built", empty fs) or "snapshot"
    tar_path: Path | None = None
    definition: api_pb2.Image | None = None
    source_sandbox: str | None = None
    ttl_seconds: int | None = None
    #: where the snapshotted sandbox's processes saw its directory (paths in an image do not move)
    seen_at: Path | None = None


@dataclass
class SandboxState:
    id: str
    task_id: str
    app_id: str
    root: Path
    image_id: str
    workdir: str | None
    timeout_secs: int
    milli_cpu: int
    memory_mb: int
    memory_mb_max: int
    milli_cpu_max: int
    entrypoint_args: list[str]
    env: dict[str, str]
    name: str | None
    created_at: float = field(default_factory=time.time)
    result: api_pb2.GenericResult | None = None
    entrypoint: LocalProcess | None = None
    execs: dict[str, LocalProcess] = field(default_factory=dict)
    snapshots: list[str] = field(default_factory=list)
    idle_timeout_secs: int = 0
    last_active: float = field(default_factory=time.monotonic)
    path: str | None = None  # PATH of its processes when the image lacks programs
    #: from a snapshot: the path its processes see their directory at (the snapshotted
    #: sandbox's), bound there in a private mount namespace; None: ``root`` itself
    seen_at: Path | None = None
    _done: asyncio.Event = field(default_factory=asyncio.Event)
    _timer: asyncio.TimerHandle | None = None

    def touch(self) -> None:
        """An exec started or ended: the idle clock restarts."""
        self.last_active = time.monotonic()

    # -- read by tests -------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.result is not None

    @property
    def returncode(self) -> int | None:
        if self.result is None:
            return None
        if self.result.status == GENERIC.GENERIC_STATUS_TIMEOUT:
            return 124
        if self.result.status == GENERIC.GENERIC_STATUS_TERMINATED:
            return 137
        return self.result.exitcode

    def running_processes(self) -> list[LocalProcess]:
        procs = list(self.execs.values()) + (
            [self.entrypoint] if self.entrypoint else []
        )
        return [p for p in procs if not p.done()]

    @property
    def view(self) -> Path:
        """Where its processes see its directory: ``root``, or for a sandbox made from a
        filesystem snapshot the path the snapshotted sandbox saw (as in a real image, a
        snapshot's files keep their paths, so a restored shell's cwd and ``$HOME`` hold)."""
        return self.seen_at or self.root

    def host_path(self, path: str) -> Path:
        """Where an in-sandbox path lives, as its processes see it (see the module docstring)."""
        prefix = (
            self.workdir.rstrip("/") if self.workdir and self.workdir != "/" else None
        )
        if prefix and (path == prefix or path.startswith(prefix + "/")):
            return self.view / path[len(prefix) :].lstrip("/")
        if not os.path.isabs(path):
            return self.view / path
        return Path(path)

    def spawn(self, argv: list[str], cwd: str) -> tuple[list[str], str]:
        """The argv and cwd to start a process of this sandbox with: as they are, or for a
        sandbox from a snapshot in a private mount namespace where ``root`` is bound at
        ``view`` (two forks of one snapshot see the same paths, each its own files)."""
        if self.seen_at is None or self.seen_at == self.root:
            return argv, cwd
        unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
        if unshare is None:
            raise RuntimeError("emulator: a sandbox from a snapshot needs unshare(1) (util-linux)")
        script = (
            'mkdir -p -- "$2" && mount --bind -- "$1" "$2" || exit 126; '
            'cd -- "$3" 2>/dev/null || { echo "modal-emulator: cannot enter $3" >&2; exit 126; }; '
            'shift 3; exec "$@"'
        )
        # Not root: a user namespace mapping this user to itself grants the mount.
        user = [] if os.geteuid() == 0 else ["--map-current-user"]
        wrapped = [unshare, *user, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh",
                   str(self.root), str(self.seen_at), cwd, *argv]
        return wrapped, str(self.root)

    # -- process environment -------------------------------------------------------------
    def process_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": self.path or os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.view),
            "LANG": "C.UTF-8",
            "MODAL_SANDBOX_ID": self.id,
            "MODAL_TASK_ID": self.task_id,
        }
        env.update(self.env)
        env.update(extra or {})
        return env


def env_from_secret_sources(sources) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in sources:
        if src.WhichOneof("source") == "env":
            env.update(dict(src.env.contents))
    return env


def _bin_without(where: Path, lacks: frozenset[str]) -> Path:
    """A PATH directory with every program of this host's PATH except ``lacks``:
    what an exec sees in an image that does not ship them (e.g. no bash)."""
    where.mkdir(parents=True, exist_ok=True)
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            target, link = os.path.join(d, name), where / name
            if name in lacks or link.exists() or not os.access(target, os.X_OK):
                continue
            link.symlink_to(target)
    return where


class Store:
    """All emulated objects. Only touched from the emulator's event loop."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        (base_dir / "sandboxes").mkdir(parents=True, exist_ok=True)
        (base_dir / "images").mkdir(parents=True, exist_ok=True)
        self.apps: dict[str, AppRecord] = {}
        self.apps_by_name: dict[tuple[str, str], str] = {}
        self.images: dict[str, ImageRecord] = {}
        self.sandboxes: dict[str, SandboxState] = {}
        self.tasks: dict[str, str] = {}  # task id -> sandbox id
        self.unknown_image_ids: list[str] = []
        self.deleted_image_ids: set[str] = set()
        self.snapshots_by_key: dict[tuple[str, str], str] = {}  # (task id, snapshot_id) -> image id

    # -- apps ----------------------------------------------------------------------------
    def app_get_or_create(
        self, name: str, environment: str, create: bool
    ) -> AppRecord | None:
        key = (environment, name)
        if key in self.apps_by_name:
            return self.apps[self.apps_by_name[key]]
        if not create:
            return None
        app = AppRecord(new_id("ap"), name, environment)
        self.apps[app.id] = app
        self.apps_by_name[key] = app.id
        return app

    # -- images --------------------------------------------------------------------------
    def image_get_or_create(self, definition: api_pb2.Image) -> ImageRecord:
        # Content-addressed like the real service, so the same definition gets the same id
        # in every emulator (the SDK caches hydrated module-level images per process).
        digest = hashlib.sha256(
            definition.SerializeToString(deterministic=True)
        ).hexdigest()
        image_id = f"im-emu{digest[:20]}"
        rec = self.images.get(image_id)
        if rec is None:
            rec = ImageRecord(image_id, "built", definition=definition)
            self.images[image_id] = rec
        return rec

    async def snapshot(self, sb: SandboxState) -> ImageRecord:
        image_id = new_id("im")
        tar_path = self.base_dir / "images" / f"{image_id}.tar"

        def write() -> None:
            with tarfile.open(tar_path, "w") as tar:
                tar.add(sb.root, arcname=".")

        await asyncio.to_thread(write)
        rec = ImageRecord(
            image_id, "snapshot", tar_path=tar_path, source_sandbox=sb.id, seen_at=sb.view
        )
        self.images[image_id] = rec
        sb.snapshots.append(image_id)
        return rec

    def delete_image(self, image_id: str) -> None:
        """``ImageDelete``: the id is refused from then on; sandboxes already made from it keep running."""
        rec = self.images.pop(image_id, None)
        if rec is None:
            raise LookupError(f"Image {image_id} not found")
        self.deleted_image_ids.add(image_id)
        if rec.tar_path is not None:
            rec.tar_path.unlink(missing_ok=True)

    # -- sandboxes -----------------------------------------------------------------------
    async def create_sandbox(
        self,
        app_id: str,
        definition: api_pb2.Sandbox,
        env: dict[str, str],
        *,
        lacks: frozenset[str] = frozenset(),
    ) -> SandboxState:
        sandbox_id = new_id("sb")
        task_id = new_id(
            "ta", "V"
        )  # the client recognises V2 task ids by the trailing 'V'
        root = self.base_dir / "sandboxes" / sandbox_id
        root.mkdir()
        if definition.image_id in self.deleted_image_ids:
            root.rmdir()
            raise LookupError(f"Image {definition.image_id} not found")
        image = self.images.get(definition.image_id)
        if image is None:
            # An id this emulator never issued (e.g. the SDK's process-wide default image,
            # hydrated against an earlier emulator): treat it as an empty base image.
            self.unknown_image_ids.append(definition.image_id)
        elif image.kind == "snapshot" and image.tar_path is not None:
            tar_path = image.tar_path

            def extract() -> None:
                with tarfile.open(tar_path) as tar:
                    tar.extractall(root, filter="tar")

            await asyncio.to_thread(extract)
        res = definition.resources
        sb = SandboxState(
            id=sandbox_id,
            task_id=task_id,
            app_id=app_id,
            root=root,
            image_id=definition.image_id,
            workdir=definition.workdir if definition.HasField("workdir") else None,
            timeout_secs=definition.timeout_secs,
            milli_cpu=res.milli_cpu,
            memory_mb=res.memory_mb,
            milli_cpu_max=res.milli_cpu_max,
            memory_mb_max=res.memory_mb_max,
            entrypoint_args=list(definition.entrypoint_args),
            env=env,
            name=definition.name if definition.HasField("name") else None,
            idle_timeout_secs=definition.idle_timeout_secs,
            seen_at=image.seen_at if image is not None and image.kind == "snapshot" else None,
        )
        if lacks:
            sb.path = str(_bin_without(self.base_dir / "bins" / sandbox_id, lacks))
        self.sandboxes[sandbox_id] = sb
        self.tasks[task_id] = sandbox_id
        loop = asyncio.get_running_loop()
        if sb.timeout_secs:
            sb._timer = loop.call_later(
                sb.timeout_secs,
                lambda: loop.create_task(
                    self.finish(sb, GENERIC.GENERIC_STATUS_TIMEOUT)
                ),
            )
        if sb.idle_timeout_secs:
            loop.create_task(self._watch_idle(sb))
        if sb.entrypoint_args:
            argv, cwd = sb.spawn(sb.entrypoint_args, str(sb.view))
            proc = LocalProcess(id="entrypoint", argv=argv, cwd=cwd)
            sb.entrypoint = proc
            await proc.start(sb.process_env())
            loop.create_task(self._watch_entrypoint(sb, proc))
        return sb

    async def _watch_idle(self, sb: SandboxState) -> None:
        # Modal's Sandbox.create docs: idle_timeout ends a sandbox after that many
        # seconds with no running exec, stdin write or tunnel connection. How the
        # ended sandbox's result reads is not documented; the emulator reports a
        # timeout naming the idle limit.
        while sb.result is None:
            await asyncio.sleep(0.1)
            busy = any(not p.done() for p in sb.execs.values())
            if busy:
                sb.touch()
            elif time.monotonic() - sb.last_active >= sb.idle_timeout_secs:
                await self.finish(
                    sb,
                    GENERIC.GENERIC_STATUS_TIMEOUT,
                    exception=f"Sandbox idle for {sb.idle_timeout_secs}s",
                )

    async def _watch_entrypoint(self, sb: SandboxState, proc: LocalProcess) -> None:
        await proc.wait()
        if sb.result is None:
            rc = proc.returncode if proc.returncode is not None else -1
            if rc < 0:  # killed by a signal from outside
                rc = 128 - rc
            status = (
                GENERIC.GENERIC_STATUS_SUCCESS
                if rc == 0
                else GENERIC.GENERIC_STATUS_FAILURE
            )
            await self.finish(sb, status, exitcode=rc)

    async def finish(
        self, sb: SandboxState, status: int, exitcode: int = 0, exception: str = ""
    ) -> bool:
        """End the sandbox (terminate/timeout/entrypoint exit): kill every process in it."""
        if sb.result is not None:
            return False
        if status == GENERIC.GENERIC_STATUS_TIMEOUT and not exception:
            exception = f"Sandbox timed out after {sb.timeout_secs}s"
        sb.result = api_pb2.GenericResult(
            status=status, exitcode=exitcode, exception=exception
        )
        if sb._timer is not None:
            sb._timer.cancel()
        procs = list(sb.execs.values()) + ([sb.entrypoint] if sb.entrypoint else [])
        await asyncio.gather(*(p.shutdown() for p in procs), return_exceptions=True)
        sb._done.set()
        return True

    async def wait_done(self, sb: SandboxState, timeout: float) -> bool:
        if sb.result is not None:
            return True
        try:
            await asyncio.wait_for(sb._done.wait(), max(timeout, 0))
        except TimeoutError:
            pass
        return sb.result is not None

    async def shutdown(self) -> None:
        await asyncio.gather(
            *(
                self.finish(sb, GENERIC.GENERIC_STATUS_TERMINATED)
                for sb in self.sandboxes.values()
            ),
            return_exceptions=True,
        )

    def remove_files(self) -> None:
        shutil.rmtree(self.base_dir, ignore_errors=True)
