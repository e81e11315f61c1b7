"""Error envelopes the emulator sends, in the shapes the SDK parses.

The SDK (``daytona._utils.errors._parse_openapi_exception``) reads ``message``,
``code`` and ``source`` from a JSON error body and picks the exception class
from ``(source, code)`` first, then from the HTTP status.  The control plane
(NestJS) answers ``{"statusCode", "message", "error"}``; the toolbox daemon
answers the generated ``ErrorResponse`` model, which the toolbox client
deserialises for declared statuses, so daemon errors are built from that model.
"""

from __future__ import annotations

from datetime import UTC, datetime
from http import HTTPStatus

from daytona_toolbox_api_client import DaemonErrorCode, ErrorResponse

SOURCE_API = "DAYTONA_API"
SOURCE_DAEMON = "DAYTONA_DAEMON"
SOURCE_PROXY = "DAYTONA_PROXY"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


class HttpError(Exception):
    """Raised by a route handler; turned into an error response by the server."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        source: str = SOURCE_API,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.source = source
        self.headers = dict(headers or {})

    def body(self, method: str, path: str) -> dict:
        if self.source == SOURCE_DAEMON:
            code = None
            if self.code is not None:
                code = DaemonErrorCode(self.code)
            model = ErrorResponse(
                code=code,
                message=self.message,
                method=method,
                path=path,
                source=self.source,
                status_code=self.status,
                timestamp=now_iso(),
            )
            return model.to_dict()
        body: dict = {
            "statusCode": self.status,
            "message": self.message,
            "error": _reason(self.status),
            "source": self.source,
            "path": path,
            "timestamp": now_iso(),
        }
        if self.code is not None:
            body["code"] = self.code
        return body


def daemon_error(status: int, message: str, code: str | None = None) -> HttpError:
    return HttpError(status, message, code=code, source=SOURCE_DAEMON)
