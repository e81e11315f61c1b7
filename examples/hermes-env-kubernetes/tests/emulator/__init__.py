"""A local Kubernetes API server emulator whose pods are real Docker containers (see server.py)."""

from .server import USER, KubeEmulator

__all__ = ["USER", "KubeEmulator"]
