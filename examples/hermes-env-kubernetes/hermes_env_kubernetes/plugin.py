"""The module the ``hermes_env`` entry point names: it only describes the backend.

Class and config model are named as strings, so listing backends never
imports the kubernetes SDK.
"""

from __future__ import annotations

from hermes_env_core.plugins import BackendSpec, hookimpl

SPEC = BackendSpec(
    name="kubernetes",
    aliases=("k8s",),
    target="hermes_env_kubernetes.backend:KubernetesEnvironment",
    config_model="hermes_env_kubernetes.config:KubernetesConfig",
    summary="bash in a Kubernetes pod of its own (or an agent-sandbox SandboxClaim), commands over the exec websocket",
    install_hint="pip install 'kubernetes>=33'",
)


@hookimpl
def hermes_env_backends() -> list[BackendSpec]:
    return [SPEC]
