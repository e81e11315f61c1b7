"""The file sync engine shared by remote backends: push host trees before each
command, pull the target's changes back, over a pluggable ``FileSyncTransport``.
"""

from __future__ import annotations

from .archive import DEFAULT_MAX_BYTES, DEFAULT_MAX_MEMBERS
from .engine import FORCE_ENV, PushResult, RetryPolicy, SyncEngine, SyncProgress
from .filters import DEFAULT_EXCLUDES, PathFilter
from .journal import JOURNAL_ENV, PendingPull, SyncJournal
from .mapping import SyncMapping
from .options import SyncOption
from .paramiko_runner import ParamikoRunner  # imports paramiko only when called
from .pull import CONFLICT_MARKER, PullResult, SyncConflict
from .transport import (
    CommandFailedError,
    CommandRunner,
    CommandTransport,
    FileSyncTransport,
    LocalDirTransport,
    SubprocessRunner,
    TransportError,
)

__all__ = [
    "SyncOption",
    "CONFLICT_MARKER",
    "DEFAULT_EXCLUDES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_MEMBERS",
    "FORCE_ENV",
    "JOURNAL_ENV",
    "CommandFailedError",
    "CommandRunner",
    "CommandTransport",
    "FileSyncTransport",
    "LocalDirTransport",
    "ParamikoRunner",
    "PathFilter",
    "PendingPull",
    "PullResult",
    "PushResult",
    "RetryPolicy",
    "SubprocessRunner",
    "SyncConflict",
    "SyncEngine",
    "SyncJournal",
    "SyncMapping",
    "SyncProgress",
    "TransportError",
]
