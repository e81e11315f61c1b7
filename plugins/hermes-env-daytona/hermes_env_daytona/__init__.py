"""hermes-env backend for Daytona sandboxes.

Importing this package imports neither the daytona SDK nor the backend; the
backend class is ``hermes_env_daytona.backend.DaytonaEnvironment``.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
