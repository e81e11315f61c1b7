"""The core's own plugin: registers local, docker and ssh through the public hook.

This module is named by the core's ``hermes_env`` entry point, exactly as a
third-party plugin's would be, and imports nothing but the spec record.
"""

from __future__ import annotations

from .hookspecs import hookimpl
from .spec import BackendSpec

__all__ = ["hermes_env_backends"]


@hookimpl
def hermes_env_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="local",
            target="hermes_env_core.backends.local:LocalEnvironment",
            config_model="hermes_env_core.backends.local:LocalConfig",
            summary="bash on this machine, secrets filtered from its environment",
        ),
        BackendSpec(
            name="docker",
            target="hermes_env_core.backends.docker:DockerEnvironment",
            config_model="hermes_env_core.backends.docker:DockerConfig",
            summary="bash in a Docker container",
            install_hint="pip install 'hermes-env-core[docker]'",
            requires=("docker",),
        ),
        BackendSpec(
            name="ssh",
            target="hermes_env_core.backends.ssh:SSHEnvironment",
            config_model="hermes_env_core.backends.ssh:SSHConfig",
            summary="bash on a remote host over SSH",
            install_hint="pip install 'hermes-env-core[ssh]'",
            requires=("paramiko",),
        ),
    ]
