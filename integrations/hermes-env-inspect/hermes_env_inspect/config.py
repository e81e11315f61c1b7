"""What ``sandbox=("hermes", ...)`` accepts: a hermes-env TOML file, or a ``HermesSandboxConfig``.

Both resolve through ``hermes_env_core``'s own configuration (arguments >
``TERMINAL_*`` variables > the file's ``[terminal]`` tables > defaults), so a
sandbox takes exactly the options of ``hermes-env run`` and the TOML file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hermes_env_core import EnvironmentFactory, ResolvedConfig

__all__ = ["HermesSandboxConfig", "as_config", "resolve"]


class HermesSandboxConfig(BaseModel):
    """The ``hermes`` sandbox's configuration (also written as the path of a hermes-env TOML file)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str | None = Field(
        default=None, description="hermes-env backend (local, docker, ssh, ...); default $TERMINAL_ENV, the file, else local."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Backend options, as `-o KEY=VALUE` or the TOML table would give them."
    )
    config_file: str | None = Field(default=None, description="A hermes-env TOML file ([terminal] tables) to read options from.")
    workdir: str | None = Field(
        default=None,
        description=(
            "Where relative paths and commands start: 'sample' (a fresh directory per sample, removed after), "
            "'session' (the environment's own start directory) or an absolute path. Default: 'sample' on "
            "backends that share this machine's filesystem (local), else 'session'."
        ),
    )

    def __hash__(self) -> int:  # inspect keys its caches by the config: options is a dict
        return hash(json.dumps(self.model_dump(), sort_keys=True, default=str))

    @field_validator("workdir")
    @classmethod
    def _check_workdir(cls, v: str | None) -> str | None:
        if v is not None and v not in ("sample", "session") and not v.startswith("/"):
            raise ValueError(f"workdir must be 'sample', 'session' or an absolute path, got {v!r}")
        return v


def as_config(config: object) -> HermesSandboxConfig:
    """The sandbox config inspect hands over: None, a TOML path, this model, a dict or another pydantic model."""
    if config is None:
        return HermesSandboxConfig()
    if isinstance(config, HermesSandboxConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = Path(config).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"hermes sandbox: config file {str(path)!r} does not exist (cwd {os.getcwd()})")
        return HermesSandboxConfig(config_file=str(path.resolve()))
    if isinstance(config, BaseModel):
        config = config.model_dump()
    if isinstance(config, dict):
        return HermesSandboxConfig(**config)
    raise TypeError(
        f"hermes sandbox: config must be a path to a hermes-env TOML file or a HermesSandboxConfig, "
        f"got {type(config).__name__}"
    )


def resolve(config: HermesSandboxConfig, *, output_floor: int) -> tuple[EnvironmentFactory, ResolvedConfig]:
    """The backend and its validated options, adjusted for a sandbox.

    ``max_output_bytes`` is raised to ``output_floor`` (the sandbox's answers
    carry files and both output streams, encoded); a ``timeout`` nobody set
    becomes none, as an inspect ``exec()`` without a timeout has none.
    """
    factory = EnvironmentFactory(config_file=config.config_file)
    resolved = factory.resolve(config.backend, **config.options)
    update: dict[str, Any] = {}
    current = getattr(resolved.config, "max_output_bytes", None)
    if isinstance(current, int) and current < output_floor:
        update["max_output_bytes"] = output_floor
    timeout = resolved.values.get("timeout")
    if timeout is not None and timeout.source == "default":
        update["timeout"] = None
    if update:
        resolved = dataclasses.replace(resolved, config=resolved.config.model_copy(update=update))
    return factory, resolved
