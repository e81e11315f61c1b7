"""The client of the managed Modal gateway (the seed system's "tool gateway").

The contract is the one hermes-agent's client uses (NousResearch/hermes-agent,
``tools/environments/managed_modal.py`` and ``modal_utils.py``)::

    POST /v1/sandboxes                 x-idempotency-key   {image, cwd, cpu, memoryMiB, timeoutMs,
                                                            idleTimeoutMs, persistentFilesystem,
                                                            logicalKey}                      -> {id}
    POST /v1/sandboxes/{id}/execs      {execId, command, cwd, timeoutMs[, stdinData]}        -> {execId, status, ...}
    GET  /v1/sandboxes/{id}/execs/{execId}                                                   -> {status, output, returncode}
    POST /v1/sandboxes/{id}/execs/{execId}/cancel
    POST /v1/sandboxes/{id}/terminate  {snapshotBeforeTerminate}

``status`` is final when it is ``completed``, ``failed``, ``cancelled`` or
``timeout``. Errors carry ``error``, ``message`` or ``code`` in a JSON body.
Every request sends ``Authorization: Bearer <token>``; the token comes from a
``TokenSource`` and is read again when it is about to expire or is refused.
What the public client does not show is listed in the README ("Managed mode").
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from hermes_env_core.errors import BackendError, ConfigError, EnvironmentUnavailable

__all__ = [
    "FINAL_STATUSES",
    "GatewayAuthError",
    "GatewayClient",
    "GatewayError",
    "SandboxGoneError",
    "TokenSource",
]

log = logging.getLogger(__name__)

#: The statuses after which an exec is over (hermes-agent modal_utils / managed_modal).
FINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "timeout"})
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# hermes-agent reads a fresh token when the cached one expires within 120 s
# (tools/managed_tool_gateway.py: _NOUS_ACCESS_TOKEN_REFRESH_SKEW_SECONDS).
REFRESH_SKEW_S = 120.0


class GatewayError(BackendError):
    """The gateway answered with an error; ``status`` is the HTTP status."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class GatewayAuthError(GatewayError):
    """The gateway refused the token (HTTP 401/403), also after reading it again."""


class SandboxGoneError(GatewayError):
    """A call about the sandbox itself answered 404 or 410: it has ended or is unknown."""


class TokenSource:
    """Where the gateway's bearer token comes from, in the seed system's order.

    ``static`` (the ``gateway_token`` option or ``TOOL_GATEWAY_USER_TOKEN``)
    never changes. Otherwise the token is ``providers.nous.access_token`` of the
    JSON ``auth_file`` (hermes-agent's auth store, kept fresh by its own login
    and refresh flow), read again when its ``expires_at`` is within 120 s or
    when the gateway refuses it.
    """

    def __init__(self, *, static: str | None = None, auth_file: Path | None = None) -> None:
        if static is None and auth_file is None:
            raise ValueError("TokenSource needs a static token or an auth file")
        self._static = static
        self._file = auth_file
        self._lock = threading.Lock()
        self._token: str | None = None
        self._expires: float | None = None

    def describe(self) -> str:
        return "the configured token" if self._static is not None else f"the auth store {self._file}"

    @property
    def refreshable(self) -> bool:
        return self._static is None

    def get(self) -> str:
        if self._static is not None:
            return self._static
        with self._lock:
            if self._token is None or (self._expires is not None and self._expires - time.time() <= REFRESH_SKEW_S):
                self._read()
            assert self._token is not None
            return self._token

    def refresh(self, refused: str) -> str | None:
        """Read the source again after ``refused`` was turned down; the new token, if it changed."""
        if self._static is not None:
            return None
        with self._lock:
            self._read()
            return self._token if self._token != refused else None

    def _read(self) -> None:
        assert self._file is not None
        try:
            data = json.loads(self._file.read_text(encoding="utf-8-sig"))
        except FileNotFoundError:
            raise ConfigError(f"modal: the gateway auth store {self._file} does not exist (log in first)") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"modal: cannot read the gateway auth store {self._file}: {exc}") from exc
        nous = (data.get("providers") or {}).get("nous") if isinstance(data, dict) else None
        token = nous.get("access_token") if isinstance(nous, dict) else None
        if not isinstance(token, str) or not token.strip():
            raise ConfigError(f"modal: {self._file} holds no providers.nous.access_token (log in first)")
        self._token = token.strip()
        self._expires = _timestamp(nous.get("expires_at"))


def _timestamp(value: object) -> float | None:
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


class GatewayClient:
    """Blocking calls to one gateway. Thread-safe (one pooled ``httpx.Client``)."""

    def __init__(
        self,
        base_url: str,
        tokens: TokenSource,
        *,
        connect_timeout: float,
        read_timeout: float,
        retries: int = 3,
        backoff_s: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.tokens = tokens
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"User-Agent": "hermes-env-modal/0.1", "Content-Type": "application/json"},
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout),
            transport=transport,
            follow_redirects=False,
        )

    def close(self) -> None:
        self._http.close()

    # -- the API ---------------------------------------------------------------------
    def create_sandbox(self, body: Mapping[str, Any], *, key: str) -> str:
        data = self._call(
            "POST", "/v1/sandboxes", json=dict(body), headers={"x-idempotency-key": key}, what="creating a sandbox"
        )
        sandbox_id = data.get("id")
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise GatewayError(f"modal gateway: creating a sandbox: the answer has no sandbox id: {data!r:.200}")
        return sandbox_id

    def start_exec(self, sandbox_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        # The execId names the command: a retry of a lost answer names the same one.
        return self._call(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/execs",
            json=dict(body),
            headers={"x-idempotency-key": str(body["execId"])},
            what="starting a command",
            sandbox_call=True,
        )

    def poll_exec(self, sandbox_id: str, exec_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/sandboxes/{sandbox_id}/execs/{exec_id}", what="reading a command's state")

    def cancel_exec(self, sandbox_id: str, exec_id: str) -> None:
        self._call("POST", f"/v1/sandboxes/{sandbox_id}/execs/{exec_id}/cancel", what="cancelling a command")

    def terminate(self, sandbox_id: str, *, snapshot: bool) -> dict[str, Any]:
        return self._call(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/terminate",
            json={"snapshotBeforeTerminate": snapshot},
            what="terminating the sandbox",
            sandbox_call=True,
        )

    # -- transport ---------------------------------------------------------------------
    def _call(
        self,
        method: str,
        path: str,
        *,
        what: str,
        json: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        sandbox_call: bool = False,
    ) -> dict[str, Any]:
        last = ""
        reauthed = False
        attempt = 0
        while attempt <= self.retries:
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 3.0) * (0.75 + random.random() / 2))
            attempt += 1
            token = self.tokens.get()
            hdrs = {"Authorization": f"Bearer {token}", **(headers or {})}
            try:
                resp = self._http.request(method, path, json=json, headers=hdrs)
            except httpx.TimeoutException as exc:
                last = f"{type(exc).__name__} ({exc or 'timed out'})"
                continue
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code in (401, 403) and not reauthed and self.tokens.refreshable:
                reauthed = True
                if self.tokens.refresh(token) is not None:
                    attempt -= 1  # a new token is not a retry
                    continue
            if resp.status_code in _RETRY_STATUS:
                last = f"HTTP {resp.status_code}: {_message(resp)}"
                wait = _retry_after(resp)
                if wait:
                    time.sleep(min(wait, 10.0))
                continue
            return self._result(resp, what, sandbox_call=sandbox_call)
        raise EnvironmentUnavailable(
            f"modal gateway {self.base_url}: {what} failed after {self.retries + 1} attempts: {last}"
        )

    def _result(self, resp: httpx.Response, what: str, *, sandbox_call: bool) -> dict[str, Any]:
        if resp.status_code < 300:
            if not resp.content:
                return {}
            try:
                data = resp.json()
            except ValueError as exc:
                raise GatewayError(f"modal gateway: {what}: the answer is not JSON: {resp.text[:200]!r}") from exc
            if not isinstance(data, dict):
                raise GatewayError(f"modal gateway: {what}: unexpected answer {data!r:.200}")
            return data
        message = f"modal gateway {self.base_url}: {what}: HTTP {resp.status_code}: {_message(resp)}"
        if resp.status_code in (401, 403):
            raise GatewayAuthError(
                f"{message} (the token from {self.tokens.describe()} was refused)", status=resp.status_code
            )
        if sandbox_call and resp.status_code in (404, 410):
            raise SandboxGoneError(message, status=resp.status_code)
        raise GatewayError(message, status=resp.status_code)


def _message(resp: httpx.Response) -> str:
    # hermes-agent's _format_error: a string "error", "message" or "code" in a JSON body.
    try:
        data = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("error", "message", "code"):
            value = data.get(key)
            if isinstance(value, str) and value:
                return value
        return json.dumps(data)[:200]
    return resp.text[:200].strip() or resp.reason_phrase


def _retry_after(resp: httpx.Response) -> float:
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "0")))
    except ValueError:
        return 0.0
