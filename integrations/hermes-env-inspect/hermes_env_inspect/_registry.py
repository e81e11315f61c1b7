"""inspect_ai's entry point (group ``inspect_ai``): importing the sandbox registers ``hermes``."""

from __future__ import annotations

from .sandbox import HermesSandboxEnvironment

__all__ = ["HermesSandboxEnvironment"]
