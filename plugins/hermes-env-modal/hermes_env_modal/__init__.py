"""hermes-env-modal: Modal cloud sandboxes as a hermes-env backend.

Importing this package imports no SDK; ``ModalEnvironment`` is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import ModalConfig

if TYPE_CHECKING:
    from .backend import ModalEnvironment

__all__ = ["ModalConfig", "ModalEnvironment", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "ModalEnvironment":
        from .backend import ModalEnvironment

        return ModalEnvironment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
