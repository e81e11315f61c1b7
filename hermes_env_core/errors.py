"""Errors raised by hermes-env.

A command that ran and failed is an ``ExecResult`` with its exit code; everything
here means the environment itself could not do what was asked.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendNotFoundError",
    "BackendNotInstalledError",
    "ConfigError",
    "DuplicateBackendError",
    "EnvironmentClosedError",
    "EnvironmentUnavailable",
    "HermesEnvError",
    "PluginLoadError",
    "SyncError",
    "SyncConflictError",
    "TargetLostError",
    "UnsafeArchiveError",
    "UnsupportedOperation",
    "UsageError",
]


class HermesEnvError(Exception):
    """Base class of every error hermes-env raises."""


class EnvironmentUnavailable(HermesEnvError):
    """The backend cannot run commands: engine down, connection lost, SDK failure."""


class BackendError(EnvironmentUnavailable):
    """The backend failed while a command was running (never a fake exit code)."""


class TargetLostError(EnvironmentUnavailable):
    """The target went away (container removed, sandbox ended): a ``Target`` raises it from ``start``."""


class EnvironmentClosedError(EnvironmentUnavailable):
    """``execute()`` was called after ``cleanup()``."""


class ConfigError(HermesEnvError, ValueError):
    """A configuration value is missing, unknown or invalid."""


class UsageError(HermesEnvError, ValueError):
    """A request that cannot be carried out as given: no command, an unknown process id."""


class BackendNotFoundError(HermesEnvError, LookupError):
    """No installed plugin provides the requested backend name."""


class BackendNotInstalledError(BackendNotFoundError):
    """The name is a known backend whose distribution is not installed."""


class DuplicateBackendError(HermesEnvError):
    """Two plugins register the same backend name or alias."""


class PluginLoadError(HermesEnvError):
    """A plugin or its backend class could not be imported."""


class UnsupportedOperation(HermesEnvError):
    """The backend does not support this operation."""


class SyncError(HermesEnvError):
    """File sync to or from a remote environment failed."""


class SyncConflictError(SyncError):
    """A push refused because the target may hold changes that were never pulled back.

    ``pending``: the ``PendingPull`` records (host path, remote path, when and
    why the pull-back failed). A successful ``pull_files()`` lifts it.
    """

    def __init__(self, message: str, *, pending: tuple[object, ...] = ()) -> None:
        super().__init__(message)
        self.pending = pending


class UnsafeArchiveError(SyncError):
    """A pulled-back archive holds a path, link or size that is refused.

    ``report``: the ``PullResult`` of the refused pull (its ``refused`` names
    the archive and why), when pull-back raised it.
    """

    report: object | None = None
