"""Options every backend accepts; each backend's config model extends this one."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

from .output import DEFAULT_MAX_OUTPUT_BYTES
from .session import DEFAULT_EXCLUDED_PREFIXES

__all__ = ["EnvironmentConfig", "channel_default"]


def channel_default(backend_default: bool) -> bool:
    """The ``channel`` option's default: ``HERMES_ENV_CHANNEL`` when set, else the backend's."""
    value = os.environ.get("HERMES_ENV_CHANNEL", "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return backend_default


class EnvironmentConfig(BaseModel):
    """Common options. Unknown keys are rejected, naming the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str | None = Field(None, description="Names the environment; backends reuse resources by it.")
    cwd: str | None = Field(None, description="Initial working directory in the target.")
    timeout: float | None = Field(180.0, gt=0, description="Default per-command timeout in seconds.")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT_BYTES, ge=1024, description="Output kept per command.")
    spill_dir: str | None = Field(None, description="Directory for the full output of truncated commands.")
    session_exclude_prefixes: tuple[str, ...] = Field(
        DEFAULT_EXCLUDED_PREFIXES, description="Variables with these prefixes never enter the saved state."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Variables set in the environment.")
    channel: bool = Field(
        default_factory=lambda: channel_default(True),
        description="Run commands through a resident shell in the target where the backend offers one "
        "(HERMES_ENV_CHANNEL=0 or 1 sets the default).",
    )
    max_channels: int = Field(4, ge=1, le=64, description="Resident channels opened for concurrent commands.")
    kill_grace_s: float = Field(1.0, ge=0, description="Seconds between SIGTERM and SIGKILL on timeout.")
