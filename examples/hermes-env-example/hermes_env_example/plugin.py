"""The plugin module hermes-env loads through the ``hermes_env`` entry point.

It names the backend's class and config model as strings, so listing backends
never imports ``backend.py`` (or, for a real plugin, its SDK).
"""

from __future__ import annotations

from hermes_env_core.plugins import BackendSpec, hookimpl


@hookimpl
def hermes_env_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="example",
            target="hermes_env_example.backend:ExampleEnvironment",
            config_model="hermes_env_example.backend:ExampleConfig",
            summary="bash on this machine, starting in (and by default created as) its own directory",
            aliases=("example-local",),
            install_hint="pip install ./examples/hermes-env-example in a hermes-env checkout; it is not on PyPI",
        )
    ]
