"""The hooks a hermes-env plugin may implement (pluggy project ``hermes_env``).

A plugin is a module (or object) named by an entry point of the group
``hermes_env``; its functions marked ``@hookimpl`` and named ``hermes_env_*``
implement the hooks below.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .spec import BackendSpec

__all__ = ["PROJECT_NAME", "ENTRY_POINT_GROUP", "HOOK_PREFIX", "hookspec", "hookimpl", "hermes_env_backends"]

PROJECT_NAME = "hermes_env"
ENTRY_POINT_GROUP = "hermes_env"
HOOK_PREFIX = "hermes_env_"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def hermes_env_backends() -> Iterable[BackendSpec]:
    """Return the backends this plugin provides, as ``BackendSpec`` records.

    Called once per plugin when the backend registry is built: the first time
    a backend is looked up, listed or created in a process (or when a registry
    is built explicitly). It is not called again for that registry.

    Results: every implementation is called, each separately, and the records
    they return are combined in plugin registration order; the core's own
    plugin comes first. Returning ``None`` or an empty iterable is allowed. A
    name or alias returned by two plugins (or twice by one) is not resolved by
    order: looking that name up raises ``DuplicateBackendError`` naming both
    distributions. A plugin that raises here, or returns anything other than
    ``BackendSpec`` records, is reported as failed, like one whose module does
    not import.

    May not: import the backend's class or its SDK (name them in
    ``BackendSpec.target`` and ``config_model`` as strings; they are imported
    when the backend is created), start processes, touch the network, or
    read configuration. It runs every time anyone lists backends, including
    ``hermes-env backends`` on a machine where the SDK is not installed.
    """
    return ()  # a hookspec's body never runs; implementations supply the records
