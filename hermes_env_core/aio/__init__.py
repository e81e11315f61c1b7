"""The async API: ``await create_environment()``, ``await env.execute()``, ``async for chunk in env.stream()``.

A thin layer over the sync environment: every blocking call goes through
``run_in_thread`` (a dedicated executor sized for many sessions), and
``AsyncEnvironment._run`` is the one place that calls ``execute()``.
"""

from __future__ import annotations

from .environment import AsyncEnvironment, ExecStream, create_environment, run_in_thread

__all__ = ["AsyncEnvironment", "ExecStream", "create_environment", "run_in_thread"]
