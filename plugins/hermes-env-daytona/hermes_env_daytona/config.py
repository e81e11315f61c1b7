"""Options of the Daytona backend, as users type them (no SDK import here).

Credentials and the API URL default to the SDK's own variables
(``DAYTONA_API_KEY``, ``DAYTONA_API_URL``, ``DAYTONA_TARGET``); a value given
here (or as ``TERMINAL_API_KEY`` and kin) wins over them.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from hermes_env_core.config import MemorySize, memory_bytes
from hermes_env_core.environment.options import EnvironmentConfig
from hermes_env_core.sync.filters import DEFAULT_EXCLUDES

__all__ = ["SERVICE_MAX_CPU", "SERVICE_MAX_DISK_GIB", "SERVICE_MAX_MEMORY_GIB", "DaytonaConfig", "DaytonaSyncMount"]

#: Per-sandbox limits of a Daytona organisation by default (docs: 4 vCPU, 8 GB RAM, 10 GB disk).
SERVICE_MAX_CPU = 4
SERVICE_MAX_MEMORY_GIB = 8
SERVICE_MAX_DISK_GIB = 10

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class DaytonaSyncMount(BaseModel):
    """A host path kept in step with a path in the sandbox (see ``hermes_env_core.sync``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(description="Directory or file on this machine.")
    remote: str = Field(description="Path in the sandbox; relative paths are taken from the sandbox user's home.")
    include: tuple[str, ...] = Field((), description="Only paths matching these globs.")
    exclude: tuple[str, ...] = Field(DEFAULT_EXCLUDES, description="Never these globs (replaces the defaults).")
    upload_only: bool = Field(False, description="Push only; never pull the sandbox's changes back.")


def memory_gib(size: str) -> int:
    """A ``memory`` option in whole GiB, as Daytona takes it (rounded up)."""
    return -(-memory_bytes(size) // (1 << 30))


class DaytonaConfig(EnvironmentConfig):
    """Options of the ``daytona`` backend. Unknown keys are rejected."""

    api_key: SecretStr | None = Field(None, description="API key; default: DAYTONA_API_KEY.")
    api_url: str | None = Field(None, description="API URL; default: DAYTONA_API_URL, else https://app.daytona.io/api.")
    target: str | None = Field(None, description="Region; default: DAYTONA_TARGET, else the organisation's default.")

    sandbox_name: str | None = Field(
        None, description="Name of the sandbox; default 'hermes-<task_id>'. An existing one is resumed."
    )
    image: str | None = Field(None, description="Create from this image (e.g. 'python:3.12-slim').")
    snapshot: str | None = Field(None, description="Create from this snapshot (default: Daytona's default).")
    cpu: int | None = Field(None, ge=1, description="vCPUs (image sandboxes only), capped at max_cpu.")
    memory: MemorySize | None = Field(
        None, description="Memory such as '2g' (image sandboxes only; whole GiB, rounded up), capped at max_memory."
    )
    disk: int | None = Field(None, ge=1, description="Disk in GiB (image sandboxes only), capped at max_disk.")
    max_cpu: int = Field(SERVICE_MAX_CPU, ge=1, description="Cap on cpu: the organisation's per-sandbox limit.")
    max_memory: int = Field(SERVICE_MAX_MEMORY_GIB, ge=1, description="Cap on memory (GiB).")
    max_disk: int = Field(SERVICE_MAX_DISK_GIB, ge=1, description="Cap on disk (GiB).")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels set on a created sandbox.")
    auto_stop_interval: int | None = Field(
        None, ge=0, description="Minutes of inactivity before Daytona stops the sandbox (0: never; default 15)."
    )
    persistent: bool = Field(True, description="cleanup() stops the sandbox (kept for resume) instead of deleting it.")
    create_timeout: float = Field(180.0, gt=0, description="Seconds to wait for a sandbox to be created.")
    start_timeout: float = Field(120.0, gt=0, description="Seconds to wait for a sandbox to start or stop.")

    sync: tuple[DaytonaSyncMount, ...] = Field((), description="Host paths pushed before each command.")
    sync_interval_s: float = Field(5.0, ge=0, description="Seconds between two checks of the host trees.")
    pull_on_close: bool = Field(True, description="Pull the sandbox's changes back at close.")

    @model_validator(mode="after")
    def _check(self) -> DaytonaConfig:
        if self.image and self.snapshot:
            raise ValueError("give either image or snapshot, not both")
        if not self.image and any(v is not None for v in (self.cpu, self.memory, self.disk)):
            raise ValueError(
                "cpu, memory and disk apply only to sandboxes created from an image "
                "(a snapshot brings its own resources): set image too, or drop them"
            )
        if self.sandbox_name is not None and not _NAME_RE.match(self.sandbox_name):
            raise ValueError(
                f"sandbox_name {self.sandbox_name!r} may hold only letters, digits, '.', '_' and '-'"
            )
        return self
