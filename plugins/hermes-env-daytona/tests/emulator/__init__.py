"""A local emulator of the Daytona HTTP API for exercising the real ``daytona`` SDK.

See ``README.md`` beside this file for the route table, the path mapping and
the failure-injection knobs.  Only relative imports are used inside the
package, so it can be loaded under any name (the tests load it by file path).
"""

from .emulator import DaytonaEmulator, InjectedFailure, RequestRecord
from .sandboxes import EmulatedSandbox

__all__ = ["DaytonaEmulator", "EmulatedSandbox", "InjectedFailure", "RequestRecord"]
