"""Background processes: start, watch, talk to and recover long-running commands on any backend.

``ProcessRegistry.spawn(env, command)`` returns a ``BackgroundProcess``; what it
prints and when it ends arrive as ``Notification`` records on the registry's queue.
"""

from __future__ import annotations

from .buffer import DEFAULT_BUFFER_BYTES, OutputSlice
from .checkpoint import default_checkpoint_path
from .events import Notification, NotificationKind
from .process import BackgroundProcess, ProcessError, ProcessInfo, ProcessStatus
from .registry import ProcessNotFoundError, ProcessRegistry
from .sandbox import PollSettings
from .watch import DEFAULT_RATE_LIMIT, RateLimit, WatchPattern

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_RATE_LIMIT",
    "BackgroundProcess",
    "Notification",
    "NotificationKind",
    "OutputSlice",
    "PollSettings",
    "ProcessError",
    "ProcessInfo",
    "ProcessNotFoundError",
    "ProcessRegistry",
    "ProcessStatus",
    "RateLimit",
    "WatchPattern",
    "default_checkpoint_path",
]
