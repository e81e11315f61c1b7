"""The hermes-env plugin of this distribution: registers the ``modal`` backend.

Named by the ``hermes_env`` entry point; imports only the core's plugin API,
never the modal SDK (the backend class is imported when one is created).
"""

from __future__ import annotations

from hermes_env_core.plugins import BackendSpec, hookimpl

__all__ = ["hermes_env_backends"]


@hookimpl
def hermes_env_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="modal",
            target="hermes_env_modal.backend:ModalEnvironment",
            config_model="hermes_env_modal.config:ModalConfig",
            summary="bash in a Modal cloud sandbox (direct with your token, or through a managed gateway)",
            install_hint="pip install 'modal>=1.6,<1.7' 'httpx>=0.27,<1'",
            # the SDK (direct mode) and the gateway's HTTP client (managed mode)
            requires=("modal", "httpx"),
        )
    ]
