"""The ``hermes_env`` entry point: registers the singularity backend (alias apptainer).

Imports only the core's plugin records; the backend module, pydantic models
and the apptainer runtime are named as strings and imported on first use.
"""

from __future__ import annotations

from hermes_env_core.plugins import BackendSpec, hookimpl

__all__ = ["SPEC", "hermes_env_backends"]

SPEC = BackendSpec(
    name="singularity",
    aliases=("apptainer",),
    target="hermes_env_singularity.backend:SingularityEnvironment",
    config_model="hermes_env_singularity.config:SingularityConfig",
    summary="bash in an Apptainer/Singularity instance (SIF, sandbox, docker-archive: or docker://)",
    install_hint="install Apptainer (package 'apptainer') or SingularityCE; then: hermes-env doctor singularity",
)


@hookimpl
def hermes_env_backends() -> list[BackendSpec]:
    return [SPEC]
