"""The narrow waist: the execution contract every backend goes through."""

from __future__ import annotations

from .base import BaseEnvironment, CancelToken, StdinMode
from .handles import ProcessHandle, ThreadedProcessHandle
from .options import EnvironmentConfig
from .result import EXIT_CANCELLED, EXIT_CWD, EXIT_TIMEOUT, EndReason, ExecResult, Usage
from .target import API_VERSION, RunRequest, Target, TargetEnvironment, parse_api_version, run_to_end

__all__ = [
    "API_VERSION",
    "RunRequest",
    "Target",
    "TargetEnvironment",
    "parse_api_version",
    "run_to_end",
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
