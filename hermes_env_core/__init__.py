"""hermes-env: run an agent's shell commands anywhere, as if in one long-lived bash.

``create_environment()`` picks a backend by name (local, docker, ssh or one a
plugin provides); every backend runs ``execute()`` the same way.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from .config import (
    ConfigFile,
    ConfigValue,
    ConfigWarning,
    IgnoredSetting,
    MemorySize,
    ResolvedConfig,
    load_config_file,
    memory_bytes,
    resolve_config,
)
from .environment import (
    API_VERSION,
    EXIT_CANCELLED,
    EXIT_CWD,
    EXIT_TIMEOUT,
    BaseEnvironment,
    CancelToken,
    EndReason,
    EnvironmentConfig,
    ExecResult,
    ProcessHandle,
    RunRequest,
    StdinMode,
    Target,
    TargetEnvironment,
    ThreadedProcessHandle,
    Usage,
    run_to_end,
)
from .errors import (
    BackendError,
    BackendNotFoundError,
    BackendNotInstalledError,
    ConfigError,
    DuplicateBackendError,
    EnvironmentClosedError,
    EnvironmentUnavailable,
    HermesEnvError,
    PluginLoadError,
    SyncConflictError,
    SyncError,
    TargetLostError,
    UnsafeArchiveError,
    UnsupportedOperation,
    UsageError,
)
from .environment.snapshot import CorruptSnapshotError, FilesRef, Snapshot, SnapshotNotFoundError
from .factory import EnvironmentFactory, EnvironmentPool, create_environment
from .environment.named import SessionBusyError, SessionLostError
from .plugins import (
    BackendRegistry,
    BackendSpec,
    PluginInfo,
    PluginLoadWarning,
    get_registry,
    hookimpl,
    hookspec,
)

try:
    __version__ = _version("hermes-env-core")
except _PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "API_VERSION",
    "EXIT_CANCELLED",
    "EXIT_CWD",
    "EXIT_TIMEOUT",
    "BackendError",
    "BackendNotFoundError",
    "BackendNotInstalledError",
    "BackendRegistry",
    "BackendSpec",
    "BaseEnvironment",
    "CancelToken",
    "ConfigError",
    "ConfigFile",
    "ConfigValue",
    "ConfigWarning",
    "CorruptSnapshotError",
    "DuplicateBackendError",
    "EnvironmentClosedError",
    "EnvironmentConfig",
    "EnvironmentFactory",
    "EnvironmentPool",
    "EnvironmentUnavailable",
    "EndReason",
    "ExecResult",
    "FilesRef",
    "Usage",
    "HermesEnvError",
    "IgnoredSetting",
    "MemorySize",
    "PluginInfo",
    "PluginLoadError",
    "PluginLoadWarning",
    "ProcessHandle",
    "ResolvedConfig",
    "RunRequest",
    "Snapshot",
    "SnapshotNotFoundError",
    "SessionBusyError",
    "SessionLostError",
    "StdinMode",
    "SyncConflictError",
    "SyncError",
    "Target",
    "TargetEnvironment",
    "TargetLostError",
    "ThreadedProcessHandle",
    "UnsafeArchiveError",
    "UnsupportedOperation",
    "UsageError",
    "__version__",
    "create_environment",
    "get_registry",
    "hookimpl",
    "hookspec",
    "load_config_file",
    "memory_bytes",
    "resolve_config",
    "run_to_end",
]
