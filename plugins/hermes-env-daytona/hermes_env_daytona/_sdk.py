"""The daytona SDK, imported on first use, and its errors turned into hermes-env's.

Nothing here imports the SDK at module import time, so ``check_requirements``
can report a missing SDK instead of failing to import.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from hermes_env_core.errors import EnvironmentUnavailable

__all__ = ["SDK_REQUIREMENT", "call_with_rate_limit", "is_sdk_error", "sdk", "state_of", "to_unavailable"]

SDK_REQUIREMENT = "daytona>=0.226,<0.227"

T = TypeVar("T")

#: States in which a sandbox is on its way to ``started`` by itself.
COMING_UP = frozenset(
    {"creating", "starting", "restoring", "pending_build", "building_snapshot", "pulling_snapshot",
     "resizing", "snapshotting", "forking", "resuming"}
)
#: States from which ``start()`` brings a sandbox back.
RESUMABLE = frozenset({"stopped", "archived", "paused"})
#: States on the way to ``stopped``; wait for them to settle, then start.
GOING_DOWN = frozenset({"stopping", "archiving", "pausing"})
GONE = frozenset({"destroyed", "destroying"})
BROKEN = frozenset({"error", "build_failed"})

_SDK_PREFIX = re.compile(r"^Failed to [^:]{1,60}: ")
_RATE_LIMIT_ATTEMPTS = 3
_RATE_LIMIT_MAX_WAIT_S = 5.0


def sdk() -> ModuleType:
    """The ``daytona`` module, or ``EnvironmentUnavailable`` saying how to install it."""
    try:
        import daytona
    except ImportError as exc:
        raise EnvironmentUnavailable(
            f"daytona: the daytona SDK is not installed ({exc}): pip install '{SDK_REQUIREMENT}'"
        ) from exc
    return daytona


def state_of(sandbox: Any) -> str:
    state = getattr(sandbox, "state", None)
    return str(getattr(state, "value", state) or "unknown")


def is_sdk_error(exc: BaseException) -> bool:
    return isinstance(exc, sdk().DaytonaError)


def _connection_failure(exc: BaseException) -> bool:
    """A transport failure (refused, reset, DNS) somewhere in the cause chain."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 10:
        name = type(cur).__name__
        if isinstance(cur, (ConnectionError, TimeoutError)) or name in (
            "MaxRetryError", "NewConnectionError", "ConnectError", "ConnectTimeout", "ProtocolError",
            "RemoteProtocolError", "ReadError", "DaytonaConnectionError",
        ):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    text = str(exc)
    return any(s in text for s in ("Connection refused", "Max retries exceeded", "Failed to establish"))


def to_unavailable(
    exc: BaseException,
    what: str,
    *,
    api_url: str,
    cls: type[EnvironmentUnavailable] = EnvironmentUnavailable,
) -> EnvironmentUnavailable:
    """An error naming what failed, the HTTP status and what to do about it."""
    status = getattr(exc, "status_code", None)
    message = str(getattr(exc, "message", "") or exc).strip() or type(exc).__name__
    message = _SDK_PREFIX.sub("", message, count=1)  # "Failed to create sandbox: " repeats `what`
    lowered = message.lower()
    if status == 401 or type(exc).__name__ == "DaytonaAuthenticationError":
        text = (
            f"daytona: {what}: the API key was rejected by {api_url} (401 Unauthorized): {message}; "
            "check DAYTONA_API_KEY or the api_key option"
        )
    elif status in (403, 429) and any(s in lowered for s in ("limit exceeded", "quota", "limit reached")):
        text = (
            f"daytona: {what}: quota exceeded ({status}): {message}; stop or delete other sandboxes, "
            "ask for fewer resources (cpu, memory, disk) or raise the organisation's limits"
        )
    elif status == 403:
        text = f"daytona: {what}: forbidden (403): {message}; check the API key's permissions"
    elif status == 429:
        after = (getattr(exc, "headers", None) or {}).get("Retry-After")
        hint = f", retry after {after}s" if after else ""
        text = f"daytona: {what}: rate limited by the Daytona API (429 Too Many Requests{hint}): {message}"
    elif isinstance(status, int) and status >= 500:
        text = f"daytona: {what}: the Daytona service failed (HTTP {status}): {message}"
    elif status is None and _connection_failure(exc):
        text = f"daytona: {what}: cannot reach the Daytona API at {api_url}: {message}"
    elif status is not None:
        text = f"daytona: {what}: HTTP {status}: {message}"
    else:
        text = f"daytona: {what}: {message}"
    err = cls(text)
    err.__cause__ = exc
    return err


def call_with_rate_limit(fn: Callable[[], T], *, sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, retried when the API answers 429, waiting as its Retry-After asks (bounded)."""
    limited = sdk().DaytonaRateLimitError
    for attempt in range(1, _RATE_LIMIT_ATTEMPTS + 1):
        try:
            return fn()
        except limited as exc:
            if attempt == _RATE_LIMIT_ATTEMPTS:
                raise
            try:
                wait = float((exc.headers or {}).get("Retry-After", 1))
            except (TypeError, ValueError):
                wait = 1.0
            sleep(min(max(wait, 0.1), _RATE_LIMIT_MAX_WAIT_S))
    raise AssertionError("unreachable")
