"""The Docker backend's options: a validated pydantic model, hardened by default."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..config import MemorySize, memory_bytes
from ..environment.options import EnvironmentConfig

__all__ = ["DEFAULT_CAPABILITIES", "DockerConfig", "parse_size"]

#: What package managers need (dpkg chowns and sets modes on others' files,
#: apt drops to its _apt user and signals its helpers); all else is dropped.
DEFAULT_CAPABILITIES: tuple[str, ...] = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID", "KILL")

_CAPABILITIES = frozenset(
    ["AUDIT_CONTROL", "AUDIT_READ", "AUDIT_WRITE", "BLOCK_SUSPEND", "BPF", "CHECKPOINT_RESTORE", "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "IPC_LOCK", "IPC_OWNER", "KILL", "LEASE", "LINUX_IMMUTABLE", "MAC_ADMIN", "MAC_OVERRIDE", "MKNOD", "NET_ADMIN", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_RAW", "PERFMON", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_ADMIN", "SYS_BOOT", "SYS_CHROOT", "SYS_MODULE", "SYS_NICE", "SYS_PACCT", "SYS_PTRACE", "SYS_RAWIO", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "SYSLOG", "WAKE_ALARM"]
)
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([bkmg]?)i?b?$", re.IGNORECASE)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
def parse_size(value: str | int) -> int:
    """Bytes in ``512m``, ``2g``, ``1.5G``, ``65536`` (binary units, like docker)."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(value.strip())
    if m is None:
        raise ValueError(f"not a size: {value!r} (expected e.g. 512m, 2g or a number of bytes)")
    scale = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


class DockerConfig(EnvironmentConfig):
    """Options of the Docker backend. Defaults are the hardened ones."""

    image: str = Field(None, validate_default=True, description="Image to run, e.g. 'python:3.12-slim' (required).")
    docker_host: str | None = Field(None, description="Engine URL; default $DOCKER_HOST, else the local socket.")
    pull: Literal["missing", "never", "always"] = Field("missing", description="When to pull the image.")
    user: str | None = Field(None, description="User (name or uid[:gid]) commands run as; default the image's.")
    network_mode: str = Field("none", description="'none' (default), 'bridge', 'host' or a network name.")
    cpu: float | None = Field(None, gt=0, description="CPU limit in cores.")
    memory: MemorySize | None = Field("4g", description="Memory limit such as '2g' or '512m' (no swap beyond it); None for none.")
    pids_limit: int | None = Field(512, ge=8, description="Most processes at once; None for no limit.")
    read_only_root: bool = Field(False, description="Mount the image's filesystem read-only.")
    tmpfs: dict[str, str] = Field(
        default_factory=lambda: {"/tmp": "512m", "/var/tmp": "256m", "/run": "64m"},
        description="tmpfs mounts: container path -> size cap.",
    )
    tmpfs_noexec: bool = Field(False, description="Mount the tmpfs mounts noexec.")
    cap_add: tuple[str, ...] = Field(DEFAULT_CAPABILITIES, description="Capabilities kept; all others dropped.")
    no_new_privileges: bool = Field(True, description="Forbid gaining privileges (setuid binaries).")
    security_opt: tuple[str, ...] = Field((), description="More --security-opt values.")
    workspace: Literal["ephemeral", "bind", "volume"] = Field(
        "ephemeral", description="ephemeral (gone with the container), bind (a host dir) or volume (named)."
    )
    workspace_source: str | None = Field(None, description="Host directory (bind) or volume name (volume).")
    workspace_path: str = Field("/workspace", description="Where the workspace is in the container.")
    workspace_read_only: bool = Field(False, description="Mount the workspace read-only.")
    volumes: dict[str, str] = Field(default_factory=dict, description="More named volumes: name -> path[:ro].")
    workdir: str | None = Field(None, description="Working directory of the container; default workspace_path.")
    persistent: bool = Field(False, description="Keep the container after close; reuse it by task id.")
    idle_lifetime_s: float = Field(3600.0, gt=0, description="An orphaned persistent container idle this long is reaped.")

    @field_validator("image", mode="before")
    @classmethod
    def _require_image(cls, v: Any) -> Any:
        if not v:
            raise ValueError(
                "docker: the 'image' option is required (e.g. image='python:3.12-slim', "
                "or TERMINAL_IMAGE / image = ... in the [terminal.docker] table)"
            )
        return v

    @field_validator("memory")
    @classmethod
    def _check_memory(cls, v: str | None) -> str | None:
        if v is not None and memory_bytes(v) < 6 * (1 << 20):
            raise ValueError("memory must be at least 6m (docker's minimum)")
        return v

    @field_validator("tmpfs")
    @classmethod
    def _check_tmpfs(cls, v: dict[str, str]) -> dict[str, str]:
        for path, size in v.items():
            if not posixpath.isabs(path):
                raise ValueError(f"tmpfs path must be absolute: {path!r}")
            parse_size(size)
        return v

    @field_validator("cap_add")
    @classmethod
    def _check_caps(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for cap in v:
            name = cap.upper().removeprefix("CAP_")
            if name not in _CAPABILITIES:
                raise ValueError(f"unknown capability {cap!r}")
            out.append(name)
        return tuple(out)

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME_RE.match(name):
                raise ValueError(f"not a variable name: {name!r}")
        return v

    @field_validator("volumes")
    @classmethod
    def _check_volumes(cls, v: dict[str, str]) -> dict[str, str]:
        for name, spec in v.items():
            if not posixpath.isabs(spec.removesuffix(":ro").removesuffix(":rw")):
                raise ValueError(f"volume {name!r}: container path must be absolute, got {spec!r}")
        return v

    @model_validator(mode="after")
    def _check_workspace(self) -> DockerConfig:
        if not posixpath.isabs(self.workspace_path):
            raise ValueError(f"workspace_path must be absolute: {self.workspace_path!r}")
        if self.workspace == "ephemeral" and self.workspace_source:
            raise ValueError("workspace_source is only for workspace='bind' or 'volume'")
        if self.workspace == "volume" and not self.workspace_source:
            raise ValueError("workspace='volume' needs workspace_source, the volume's name")
        if self.workspace == "bind":
            src = self.workspace_source
            if not src or not os.path.isabs(src) or not os.path.isdir(src):
                raise ValueError(f"workspace='bind' needs workspace_source, an existing absolute host directory; got {src!r}")
        return self

    def container_hash(self) -> str:
        """Hash of the options that shape the container (not per-command ones)."""
        keys = set(DockerConfig.model_fields) - set(EnvironmentConfig.model_fields) - {"docker_host", "pull", "idle_lifetime_s"}
        data = self.model_dump(include=keys, mode="json")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
