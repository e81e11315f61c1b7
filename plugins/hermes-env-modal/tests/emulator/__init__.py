"""A local emulator of the Modal gRPC API calls that ``modal.Sandbox`` makes.

Lets the official, unmodified ``modal`` SDK (1.6.x) run for real against processes on
this machine. See ``README.md`` beside this file for the RPCs covered and the caveats.
"""

from .sdk import pointed_at, reset_modal_client
from .server import REALISTIC, ModalEmulator

__all__ = ["REALISTIC", "ModalEmulator", "pointed_at", "reset_modal_client"]
