"""The client of the managed gateway's REST API (v1): httpx, bearer token, retries
with idempotency keys, connect and read timeouts from the config.

The API (also in the README)::

    POST /v1/sandboxes                       create          Idempotency-Key  -> 201 {sandbox_id, restored_from, restore_error}
    POST /v1/sandboxes/{sid}/execs           start a command Idempotency-Key  -> 201 {exec_id, <poll fields>}
    GET  /v1/sandboxes/{sid}/execs/{eid}     poll ?offset=&wait_s=            -> 200 {<poll fields>}
    POST /v1/sandboxes/{sid}/execs/{eid}/cancel                                -> 202 {status}
    POST /v1/sandboxes/{sid}/terminate       {snapshot}      Idempotency-Key  -> 200 {image_id, snapshot_error}

Poll fields: ``status`` (running|finished), ``output_b64`` (bytes from
``offset`` to ``next_offset``), ``done`` (finished and all output sent),
``exit_code``, ``timed_out``, ``cancelled``, ``cwd``, ``notes``. Errors are
``{"error": {"code", "message"}}`` with the HTTP status.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import httpx

from hermes_env_core.errors import BackendError, EnvironmentUnavailable

__all__ = ["GatewayAuthError", "GatewayClient", "GatewayError", "SandboxEndedError"]

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class GatewayError(BackendError):
    """The gateway answered with an error. ``status`` and ``code`` say which."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class GatewayAuthError(GatewayError):
    """The gateway refused the bearer token (HTTP 401 or 403)."""


class SandboxEndedError(GatewayError):
    """The sandbox is gone (HTTP 404 or 410 for it): timed out, terminated or unknown."""


class GatewayClient:
    """Blocking calls to one gateway. Thread-safe (one pooled ``httpx.Client``)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        retries: int = 3,
        backoff_s: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.read_timeout = read_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}", "User-Agent": "hermes-env-modal/0.1"},
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout),
            transport=transport,
            follow_redirects=False,
        )

    def close(self) -> None:
        self._http.close()

    @property
    def poll_wait_s(self) -> float:
        """The longest a long-poll may be asked to hold, well inside the read timeout."""
        return max(0.05, min(10.0, self.read_timeout / 2))

    # -- the API ---------------------------------------------------------------------
    def create_sandbox(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/sandboxes", json=body, idempotent=True, what="creating a sandbox")

    def start_exec(self, sandbox_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            "POST", f"/v1/sandboxes/{sandbox_id}/execs", json=body, idempotent=True, what="starting a command"
        )

    def poll_exec(self, sandbox_id: str, exec_id: str, *, offset: int, wait_s: float) -> dict[str, Any]:
        return self._call(
            "GET",
            f"/v1/sandboxes/{sandbox_id}/execs/{exec_id}",
            params={"offset": offset, "wait_s": f"{wait_s:.3f}"},
            what="reading a command's output",
            extra_read_s=wait_s,
        )

    def cancel_exec(self, sandbox_id: str, exec_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/sandboxes/{sandbox_id}/execs/{exec_id}/cancel", json={}, what="cancelling")

    def terminate(self, sandbox_id: str, *, snapshot: bool) -> dict[str, Any]:
        return self._call(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/terminate",
            json={"snapshot": snapshot},
            idempotent=True,
            what="terminating the sandbox",
        )

    # -- transport ---------------------------------------------------------------------
    def _call(
        self,
        method: str,
        path: str,
        *,
        what: str,
        json: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        idempotent: bool = False,
        extra_read_s: float = 0.0,
    ) -> dict[str, Any]:
        # One key for every attempt of this call: a retry after a lost answer
        # gets the first attempt's result instead of doing the work twice.
        headers = {"Idempotency-Key": uuid.uuid4().hex} if idempotent else {}
        timeout = None
        if extra_read_s:
            t = self._http.timeout
            timeout = httpx.Timeout(connect=t.connect, read=(t.read or 0) + extra_read_s, write=t.write, pool=t.pool)
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), 3.0) * (0.75 + random.random() / 2)
                time.sleep(delay)
            try:
                kwargs: dict[str, Any] = {"json": json, "params": params, "headers": headers}
                if timeout is not None:
                    kwargs["timeout"] = timeout
                resp = self._http.request(method, path, **kwargs)
            except httpx.TimeoutException as exc:
                last = f"{type(exc).__name__} ({exc or 'timed out'})"
                continue
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code in _RETRY_STATUS:
                last = f"HTTP {resp.status_code}: {_message(resp)}"
                wait = _retry_after(resp)
                if wait:
                    time.sleep(min(wait, 10.0))
                continue
            return self._result(resp, what)
        raise EnvironmentUnavailable(
            f"modal gateway {self.base_url}: {what} failed after {self.retries + 1} attempts: {last}"
        )

    def _result(self, resp: httpx.Response, what: str) -> dict[str, Any]:
        if resp.status_code < 300:
            try:
                data = resp.json()
            except ValueError as exc:
                raise GatewayError(f"modal gateway: {what}: the answer is not JSON: {resp.text[:200]!r}") from exc
            if not isinstance(data, dict):
                raise GatewayError(f"modal gateway: {what}: unexpected answer {data!r:.200}")
            return data
        code = _code(resp)
        message = f"modal gateway {self.base_url}: {what}: HTTP {resp.status_code} {code}: {_message(resp)}"
        if resp.status_code in (401, 403):
            raise GatewayAuthError(
                message + " (check the gateway_token option)", status=resp.status_code, code=code
            )
        if resp.status_code in (404, 410) and code in ("sandbox_not_found", "sandbox_ended"):
            raise SandboxEndedError(message, status=resp.status_code, code=code)
        raise GatewayError(message, status=resp.status_code, code=code)


def _error(resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError:
        return {}
    err = data.get("error") if isinstance(data, dict) else None
    return err if isinstance(err, dict) else {}


def _code(resp: httpx.Response) -> str:
    return str(_error(resp).get("code") or "error")


def _message(resp: httpx.Response) -> str:
    return str(_error(resp).get("message") or resp.text[:200] or resp.reason_phrase)


def _retry_after(resp: httpx.Response) -> float:
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "0")))
    except ValueError:
        return 0.0
