"""The module hermes-env loads through the ``hermes_env`` entry point.

It names the backend class and its config model as strings, so listing
backends never imports the daytona SDK.
"""

from __future__ import annotations

from hermes_env_core.plugins import BackendSpec, hookimpl

__all__ = ["hermes_env_backends"]


@hookimpl
def hermes_env_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="daytona",
            target="hermes_env_daytona.backend:DaytonaEnvironment",
            config_model="hermes_env_daytona.config:DaytonaConfig",
            summary="bash in a Daytona cloud sandbox, one per task id (resumed when stopped)",
            install_hint="pip install 'daytona>=0.226,<0.227'",
            requires=("daytona",),
        )
    ]
