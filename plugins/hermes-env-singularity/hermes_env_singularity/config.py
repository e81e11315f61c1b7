"""Options of the singularity backend, validated where users type them.

Imported when options are resolved (``hermes-env config``) or a backend is
created; it needs only pydantic and the core's ``EnvironmentConfig``.
"""

from __future__ import annotations

import posixpath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hermes_env_core.config import MemorySize
from hermes_env_core.environment.options import EnvironmentConfig

__all__ = ["BindMount", "SingularityConfig"]



class BindMount(BaseModel):
    """A host path made visible in the container; ``"SRC[:DST][:ro|rw]"`` as a string."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(..., min_length=1, description="Host path (absolute, or ~-relative).")
    target: str | None = Field(None, description="Path in the container; defaults to the source.")
    read_only: bool = Field(False, description="Mount read-only.")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        parts = value.split(":")
        read_only = False
        if len(parts) > 1 and parts[-1] in ("ro", "rw"):
            read_only = parts.pop() == "ro"
        if len(parts) > 2:
            raise ValueError(f"bind {value!r}: expected SRC[:DST][:ro|rw]")
        return {"source": parts[0], "target": parts[1] if len(parts) > 1 else None, "read_only": read_only}

    @field_validator("source", "target")
    @classmethod
    def _no_separators(cls, value: str | None) -> str | None:
        if value is not None and ("," in value or ":" in value):
            # apptainer splits --bind specs on both
            raise ValueError(f"bind path {value!r} may not contain ',' or ':'")
        return value

    @field_validator("target")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not posixpath.isabs(value):
            raise ValueError(f"bind target {value!r} must be an absolute path in the container")
        return value

    @property
    def destination(self) -> str:
        return self.target or self.source

    def spec(self, source: str) -> str:
        """The ``--bind`` argument, with the host path resolved to ``source``."""
        return f"{source}:{self.target or source}" + (":ro" if self.read_only else "")


class SingularityConfig(EnvironmentConfig):
    """Options of the singularity (Apptainer) backend. ``image`` is required.

    ``image`` is a SIF file, a sandbox directory, ``docker-archive:PATH``, or a
    reference apptainer can build (``docker://``, ``oras://``, ``library://``,
    ``oci-archive:`` ...), which is built once into a SIF in ``cache_dir``.
    """

    image: str = Field(..., min_length=1, description="SIF, sandbox dir, docker-archive:PATH or docker://REF.")
    executable: str | None = Field(
        None, description="apptainer or singularity binary (name or path); default: apptainer, then singularity."
    )
    apptainer_conf: str | None = Field(
        None, description="An apptainer.conf to use instead of the installed one (-c; root or unprivileged installs)."
    )
    cache_dir: str | None = Field(
        None, description="Where built SIFs are kept; default $APPTAINER_CACHEDIR/hermes-env, else ~/.cache."
    )
    build_timeout: float = Field(1800.0, gt=0, description="Seconds one image build may take.")
    no_https: bool = Field(False, description="Talk plain HTTP to a docker:// registry (local registries).")
    overlay: Literal["tmpfs", "persistent", "none"] = Field(
        "tmpfs",
        description="Writable layer: tmpfs (lost at cleanup), persistent (a directory kept per task_id), none.",
    )
    overlay_dir: str | None = Field(
        None, description="Where persistent overlays live; default ~/.cache/hermes-env/singularity/overlays."
    )
    cpu: float | None = Field(None, gt=0, description="CPU limit in cores (--cpus), where the host supports cgroups.")
    memory: MemorySize | None = Field(None, description="Memory limit (--memory), such as '512m' or '2g'.")
    require_limits: bool = Field(False, description="Fail instead of running unlimited when limits are unsupported.")
    binds: tuple[BindMount, ...] = Field((), description="Bind mounts: 'SRC[:DST][:ro]' strings or tables.")
    inherit_env: bool = Field(
        False, description="Pass this process's environment into the container (secrets filtered out)."
    )
    env_passthrough: tuple[str, ...] = Field(
        (), description="Host variables (globs) passed into the container even if they look like secrets."
    )
    env_blocklist: tuple[str, ...] = Field((), description="More host variable names (globs) kept out.")
    userns: bool = Field(False, description="Run the instance in a user namespace (--userns).")
    start_timeout: float = Field(300.0, gt=0, description="Seconds 'instance start' may take.")
    stop_timeout: int = Field(0, ge=0, description="Seconds the instance gets after SIGTERM at cleanup (0: kill).")
    extra_args: tuple[str, ...] = Field((), description="More 'instance start' options, passed as given.")

    @field_validator("binds", mode="before")
    @classmethod
    def _one_bind(cls, value: Any) -> Any:
        return (value,) if isinstance(value, (str, dict)) else value

    @field_validator("extra_args")
    @classmethod
    def _not_ours(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for arg in value:
            if arg.split("=")[0] in ("--writable-tmpfs", "--overlay", "-o", "--cpus", "--memory", "--bind", "-B"):
                raise ValueError(f"extra_args: use the config field for {arg.split('=')[0]}, not extra_args")
        return value

    @model_validator(mode="after")
    def _persistent_needs_task(self) -> SingularityConfig:
        if self.overlay == "persistent" and not self.task_id:
            raise ValueError("overlay='persistent' keeps a directory per task: set task_id")
        return self
