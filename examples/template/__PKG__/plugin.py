"""The module the ``hermes_env`` entry point names: imported whenever anyone lists backends, so it imports no SDK."""

from __future__ import annotations

from hermes_env_core.plugins import BackendSpec, hookimpl


@hookimpl
def hermes_env_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="__NAME__",
            target="__PKG__.backend:__CLASS__Environment",
            config_model="__PKG__.backend:__CLASS__Config",
            summary="TODO: one line saying where commands run",
            install_hint="pip install __DIST__",
            # requires=("your_sdk",),  # lets `hermes-env backends` see a missing SDK without importing it
        )
    ]
