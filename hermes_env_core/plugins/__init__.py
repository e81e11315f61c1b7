"""Plugin discovery: the ``hermes_env_backends`` hook, ``BackendSpec`` and the backend registry.

Importing this package imports no backend and no SDK.
"""

from __future__ import annotations

from .hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec
from .manager import PluginInfo, PluginLoadWarning
from .registry import (
    KNOWN_BACKENDS,
    STRICT_ENV_VAR,
    BackendRegistry,
    KnownBackend,
    get_registry,
    reset_registry,
)
from .spec import BackendSpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "KNOWN_BACKENDS",
    "PROJECT_NAME",
    "STRICT_ENV_VAR",
    "BackendRegistry",
    "BackendSpec",
    "KnownBackend",
    "PluginInfo",
    "PluginLoadWarning",
    "get_registry",
    "hookimpl",
    "hookspec",
    "reset_registry",
]
