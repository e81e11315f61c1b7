"""hermes-env-singularity: the Apptainer/Singularity backend of hermes-env, as a plugin.

Importing this package is cheap; the backend lives in ``.backend`` and is
imported when an environment is created.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
