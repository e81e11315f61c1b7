"""The narrow waist: the execution contract every backend goes through."""

from __future__ import annotations

from .base import BaseEnvironment, CancelToken, StdinMode
from .handles import ProcessHandle, ThreadedProcessHandle
from .options import EnvironmentConfig
from .result import EXIT_CANCELLED, EXIT_CWD, EXIT_TIMEOUT, EndReason, ExecResult, Usage

__all__ = [
    "BaseEnvironment",
    "CancelToken",
    "EXIT_CANCELLED",
    "EXIT_CWD",
    "EXIT_TIMEOUT",
    "EnvironmentConfig",
    "EndReason",
    "ExecResult",
    "Usage",
    "ProcessHandle",
    "StdinMode",
    "ThreadedProcessHandle",
]
