"""One emulated sandbox: its record, its directory, its processes.

Path mapping
------------
Each sandbox is backed by a real directory ``<emulator root>/sandboxes/<id>``.
That directory's real absolute path *is* the sandbox's home and work directory:
``/user-home-dir`` and ``/work-dir`` return it, exec'd commands start in it with
``HOME`` set to it.  So a path means the same thing to the file API and to a
command — the SDK sends absolute paths unchanged and ``bash`` sees the same
files.  Rules applied to every path the SDK sends (file calls, exec ``cwd``):

* relative paths resolve against the work directory (as on Daytona);
* an absolute path must lie inside the sandbox directory once ``..`` and
  symlinks are resolved; anything else (``/etc/passwd``, ``../other-sandbox``,
  a symlink pointing out) is refused with 403 ``FILE_ACCESS_DENIED``.

Commands themselves are not confined (they are ordinary local processes and can
touch ``/tmp`` or anything else the test user can) — the emulator fakes the
API, not the isolation.  Session bookkeeping lives beside, not inside, the
sandbox directory so it never shows up in listings.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from daytona_api_client import BuildInfo, Sandbox, SandboxDesiredState, SandboxListItem, SandboxState

from .errors import daemon_error
from .images import DEBIAN, ImageProfile, executable, path_without_bash
from .processes import ProcessTable, ShellSession
from .ptys import PtySession

DEFAULT_USER = "daytona"
DEFAULT_TARGET = "us"
DEFAULT_SNAPSHOT = "daytonaio/sandbox:emulated"
ORGANIZATION_ID = "emulator-org"

# Where each settled state points the desired state.
_DESIRED = {
    "started": SandboxDesiredState.STARTED,
    "starting": SandboxDesiredState.STARTED,
    "creating": SandboxDesiredState.STARTED,
    "stopped": SandboxDesiredState.STOPPED,
    "stopping": SandboxDesiredState.STOPPED,
    "archived": SandboxDesiredState.ARCHIVED,
    "archiving": SandboxDesiredState.ARCHIVED,
    "restoring": SandboxDesiredState.STARTED,
    "resuming": SandboxDesiredState.STARTED,
    "pausing": SandboxDesiredState.PAUSED,
    "paused": SandboxDesiredState.PAUSED,
    "destroyed": SandboxDesiredState.DESTROYED,
    "destroying": SandboxDesiredState.DESTROYED,
}


def _iso(ts: datetime) -> str:
    return ts.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class EmulatedSandbox:
    id: str
    name: str
    root: Path
    state_dir: Path
    user: str = DEFAULT_USER
    snapshot: str | None = DEFAULT_SNAPSHOT
    dockerfile: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    public: bool = False
    target: str = DEFAULT_TARGET
    cpu: int = 1
    gpu: int = 0
    memory: int = 1
    disk: int = 3
    state: str = "started"
    error_reason: str | None = None
    recoverable: bool | None = None
    auto_stop_interval: int = 15
    auto_archive_interval: int = 10080
    auto_delete_interval: int = -1
    network_block_all: bool = False
    profile: ImageProfile = DEBIAN
    create_request: dict = field(default_factory=dict)
    #: time.monotonic() of the last request about this sandbox (auto-stop counts idleness from it)
    last_activity: float = field(default_factory=time.monotonic)
    #: time.monotonic() when it last reached ``stopped`` (auto-archive counts from it)
    stopped_at: float | None = None
    created_at: datetime = field(default_factory=_now)
    updated_at: datetime = field(default_factory=_now)
    processes: ProcessTable = field(default_factory=ProcessTable)
    sessions: dict[str, ShellSession] = field(default_factory=dict)
    ptys: dict[str, PtySession] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)

    @classmethod
    def new(cls, base: Path, **kwargs) -> EmulatedSandbox:
        sandbox_id = str(uuid.uuid4())
        root = base / "sandboxes" / sandbox_id
        root.mkdir(parents=True)
        state_dir = base / "state" / sandbox_id
        state_dir.mkdir(parents=True)
        name = kwargs.pop("name", None) or sandbox_id
        return cls(id=sandbox_id, name=name, root=root.resolve(), state_dir=state_dir, **kwargs)

    # ----------------------------------------------------------------- paths
    @property
    def home(self) -> Path:
        return self.root

    @property
    def work_dir(self) -> Path:
        return self.root

    def resolve(self, path: str | None, *, default: Path | None = None) -> Path:
        """Map a path the SDK sent to a real path inside this sandbox, or raise 403/400."""
        if path is None or path == "":
            if default is not None:
                return default
            raise daemon_error(400, "path is required", "INVALID_FILE_PATH")
        if "\x00" in path:
            raise daemon_error(400, f"invalid path: {path!r}", "INVALID_FILE_PATH")
        candidate = Path(path)
        if not candidate.is_absolute():
            candidate = self.work_dir / candidate
        real = Path(os.path.realpath(candidate))
        if real == self.root or self.root in real.parents:
            return real
        # The daemon's file API acts as the sandbox's user on the sandbox's whole filesystem,
        # so /tmp is reachable too. Sandboxes here share this machine's /tmp: it is allowed,
        # except the emulator's own tree (other sandboxes' homes).
        emu_root = self.root.parent.parent
        tmp = Path(os.path.realpath(tempfile.gettempdir()))
        if tmp in real.parents and real != emu_root and emu_root not in real.parents and real not in emu_root.parents:
            return real
        raise daemon_error(403, f"access denied: {path} is outside the sandbox", "FILE_ACCESS_DENIED")

    # ------------------------------------------------------------- processes
    def daemon_shell(self) -> str:
        """The program the daemon runs commands with (see ``images.py``)."""
        return executable(self.profile.daemon_shell())

    def process_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        if not self.profile.has_bash:
            path = path_without_bash(self.state_dir.parent.parent, path)
        env = {
            "PATH": path,
            "HOME": str(self.home),
            "USER": self.user,
            "LOGNAME": self.user,
            "SHELL": self.profile.daemon_shell() if self.profile.daemon_shell().startswith("/") else "/bin/sh",
            "LANG": "C.UTF-8",
            "DAYTONA_SANDBOX_ID": self.id,
            "DAYTONA_SANDBOX_USER": self.user,
        }
        env.update(self.env)
        if extra:
            env.update(extra)
        return env

    def kill_processes(self) -> None:
        with self.lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
            terminals = list(self.ptys.values())
        for session in sessions:
            session.close()
        for terminal in terminals:
            terminal.kill(cut=True)  # the daemon goes with the sandbox: connections are cut
        self.processes.kill_all()

    def remove_files(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    # ----------------------------------------------------------------- state
    def set_state(self, state: str, *, reason: str | None = None) -> str:
        old = self.state
        self.state = state
        self.updated_at = _now()
        self.last_activity = time.monotonic()
        self.stopped_at = self.last_activity if state == "stopped" else None
        if state == "error":
            self.error_reason = reason or self.error_reason or "emulated error"
        elif state not in ("build_failed",):
            self.error_reason = reason
        return old

    # ------------------------------------------------------------------ DTOs
    def _common(self, proxy_url: str) -> dict:
        return {
            "id": self.id,
            "organization_id": ORGANIZATION_ID,
            "name": self.name,
            "snapshot": self.snapshot,
            "user": self.user,
            "labels": dict(self.labels),
            "public": self.public,
            "network_block_all": self.network_block_all,
            "target": self.target,
            "cpu": self.cpu,
            "gpu": self.gpu,
            "memory": self.memory,
            "disk": self.disk,
            "state": SandboxState(self.state),
            "desired_state": _DESIRED.get(self.state),
            "error_reason": self.error_reason,
            "recoverable": self.recoverable,
            "backup_state": "None",
            "auto_stop_interval": self.auto_stop_interval,
            "auto_archive_interval": self.auto_archive_interval,
            "auto_delete_interval": self.auto_delete_interval,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "last_activity_at": _iso(self.updated_at),
            "daemon_version": "emulator",
            "toolbox_proxy_url": proxy_url,
        }

    def to_dto(self, proxy_url: str) -> Sandbox:
        build_info = None
        if self.dockerfile is not None:
            build_info = BuildInfo(
                dockerfile_content=self.dockerfile,
                created_at=self.created_at,
                updated_at=self.created_at,
                snapshot_ref=self.snapshot or DEFAULT_SNAPSHOT,
            )
        return Sandbox(env=dict(self.env), kvm=False, volumes=[], build_info=build_info, **self._common(proxy_url))

    def to_list_item(self, proxy_url: str) -> SandboxListItem:
        return SandboxListItem(**self._common(proxy_url))
