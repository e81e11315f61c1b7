"""Request/response plumbing on top of ``http.server`` (no third-party framework)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from email.message import Message
from enum import Enum
from typing import Any

from .errors import HttpError

MAX_BODY_BYTES = 1 << 30


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Message
    body: bytes
    params: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        if not self.body:
            raise HttpError(400, "request body is required")
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise HttpError(400, f"invalid JSON body: {exc}") from exc

    def arg(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else default

    def args(self, name: str) -> list[str]:
        """A list-valued query parameter, given repeated or comma-separated."""
        out: list[str] = []
        for value in self.query.get(name, []):
            out.extend(v for v in value.split(",") if v)
        return out

    def flag(self, name: str) -> bool | None:
        value = self.arg(name)
        if value is None:
            return None
        return value.lower() in ("1", "true", "yes")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def _plain(obj: Any) -> Any:
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return obj.to_dict()
    if isinstance(obj, list):
        return [_plain(o) for o in obj]
    return obj


def _json_default(obj: Any) -> Any:
    if isinstance(obj, datetime):
        return obj.isoformat().replace("+00:00", "Z")
    if isinstance(obj, Enum):
        return obj.value
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def json_response(obj: Any, status: int = 200) -> Response:
    """Serialise a generated SDK model (via its own ``to_dict``), a list of them, or plain JSON."""
    return Response(status=status, body=json.dumps(_plain(obj), default=_json_default).encode("utf-8"))


def empty(status: int) -> Response:
    return Response(status=status, body=b"", content_type=None)


Handler = Callable[[Request], Response]


class Router:
    """Routes written as ``/sandbox/{id}/start``; ``{name}`` matches one path segment."""

    def __init__(self) -> None:
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern.rstrip("/") or "/")
        self._routes.append((method, re.compile(f"^{regex}/?$"), handler))

    def match(self, method: str, path: str) -> tuple[Handler, dict[str, str]] | None:
        """The handler for (method, path); raises 405 when only the method is wrong."""
        path_matched = False
        for route_method, regex, handler in self._routes:
            m = regex.match(path)
            if not m:
                continue
            path_matched = True
            if route_method == method:
                return handler, m.groupdict()
        if path_matched:
            raise HttpError(405, f"method {method} not allowed on {path}")
        return None
