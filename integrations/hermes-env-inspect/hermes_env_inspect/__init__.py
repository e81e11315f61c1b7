"""hermes-env-inspect: an inspect_ai sandbox named ``hermes`` that runs on any hermes-env backend.

``sandbox=("hermes", "hermes-env.toml")`` or ``SandboxEnvironmentSpec("hermes",
HermesSandboxConfig(backend="docker", options={"image": ...}))``.
"""

from __future__ import annotations

from .config import HermesSandboxConfig
from .sandbox import HermesSandboxEnvironment

__all__ = ["HermesSandboxConfig", "HermesSandboxEnvironment"]
