"""Running the MCP server: over stdio, or streamable HTTP behind a bearer token."""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from ..errors import HermesEnvError
from ..factory import EnvironmentFactory
from .server import SessionTable, build_server

__all__ = ["TOKEN_ENV_VAR", "serve"]

log = logging.getLogger("hermes_env_core.mcp")

PROG = "hermes-env mcp"
_MAX_BODY = 4 * 1024 * 1024
#: Where the bearer token may come from besides --token-file (never from the command line).
TOKEN_ENV_VAR = "HERMES_ENV_MCP_TOKEN"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"{PROG}: %(levelname)s: %(message)s")
    factory = EnvironmentFactory(config_file=args.config_file)
    options = dict(args.option)

    def opener_factory() -> Callable[[], Any]:
        if getattr(args, "session", None):
            return lambda: factory.create(args.env, option_strings=options, session=args.session)
        return lambda: factory.create(args.env, option_strings=options)

    try:
        backend = factory.resolve(args.env, option_strings=options).backend
    except HermesEnvError as exc:
        # Still serve: every tool call then says what is wrong, where the agent can read it.
        backend = f"unavailable ({exc})"
    table = SessionTable(opener_factory)
    if args.http is None:
        print(f"{PROG}: serving backend {backend} over stdio", file=sys.stderr, flush=True)
        anyio.run(_serve_stdio, table)
        return 0
    try:
        token, generated = _http_token(args.token_file)
    except HermesEnvError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    host, port = args.http
    try:
        sock = _bind(host, port)
    except OSError as exc:
        print(f"{PROG}: error: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"{PROG}: serving backend {backend} at http://{shown}:{bound}/mcp", file=sys.stderr, flush=True)
    if generated:
        print(f"{PROG}: bearer token: {token}", file=sys.stderr, flush=True)
    stopped_by: list[int] = []
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(_serve_http, table, sock, host, token, args.max_sessions, args.idle_timeout, stopped_by)
    if stopped_by:
        print(f"{PROG}: stopped by {signal.Signals(stopped_by[0]).name}", file=sys.stderr, flush=True)
        return 128 + stopped_by[0]
    return 0


async def _serve_stdio(table: SessionTable) -> None:
    from mcp.server.stdio import stdio_server

    from mcp.server.runner import serve_loop

    server = build_server(table, http=False)
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            # SIGTERM/SIGHUP/SIGINT from the client or a supervisor: close the environment, do not orphan
            # commands. Then exit at once with 128+signal (as docker run): the SDK's stdin reader sits in a
            # thread that no cancellation reaches.
            with anyio.open_signal_receiver(*_STOP_SIGNALS) as signals:
                async for signum in signals:
                    with anyio.CancelScope(shield=True):
                        await table.close_all()
                    sys.stderr.flush()
                    os._exit(128 + int(signum))

        tg.start_soon(stop_on_signal)
        # The handshake loop (not Server.run's dual-era one): the session is the connection, see build_server.
        async with server.lifespan(server) as state, stdio_server() as (read_stream, write_stream):
            await serve_loop(server, read_stream, write_stream, lifespan_state=state)
        tg.cancel_scope.cancel()


def _http_token(path: str | None) -> tuple[str, bool]:
    """(the bearer token, whether it was generated): ``--token-file``, else ``$HERMES_ENV_MCP_TOKEN``, else new."""
    from_env = os.environ.pop(TOKEN_ENV_VAR, None)  # popped: the commands this server runs never see it
    if path and from_env:
        raise HermesEnvError(f"the token is given twice, by --token-file and by ${TOKEN_ENV_VAR}: keep one")
    if path:
        return _read_token(path), False
    if from_env:
        return _check_token(from_env.strip(), f"${TOKEN_ENV_VAR}"), False
    return secrets.token_urlsafe(32), True


def _read_token(path: str) -> str:
    p = Path(path).expanduser()
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError as exc:
        raise HermesEnvError(f"cannot read the token file {path!r}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        # As ssh with its keys: a secret others can read (or replace) is no secret.
        if st.st_mode & 0o077:
            raise HermesEnvError(
                f"the token file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: group or others can "
                f"access it; make it private: chmod 600 {shlex.quote(path)}"
            )
        if st.st_uid not in (os.getuid(), 0):
            raise HermesEnvError(
                f"the token file {path!r} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
                "another user could change it"
            )
        try:
            token = fh.read().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise HermesEnvError(f"cannot read the token file {path!r}: {exc}") from None
    return _check_token(token, f"the token file {path!r}")


def _check_token(token: str, where: str) -> str:
    if len(token) < 16 or any(c.isspace() for c in token):
        raise HermesEnvError(f"the token in {where} must be one word of at least 16 characters")
    return token


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def _serve_http(
    table: SessionTable,
    sock: socket.socket,
    host: str,
    token: str,
    max_sessions: int,
    idle_timeout: float,
    stopped_by: list[int],
) -> None:
    import uvicorn

    class _Server(uvicorn.Server):
        def capture_signals(self) -> contextlib.nullcontext[None]:  # type: ignore[override]
            return contextlib.nullcontext()  # ours, below: every signal, and the commands stop first

    server = build_server(table, http=True)
    app = server.streamable_http_app(
        host=host, max_sessions=max_sessions, session_idle_timeout=idle_timeout,
    )
    guarded = SessionGuard(app, table, token=token, idle_timeout=idle_timeout)
    config = uvicorn.Config(guarded, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    userver = _Server(config)

    async def stop_on_signal() -> None:
        # The running commands are cancelled and the environments closed before the HTTP side winds down,
        # so no graceful-shutdown wait keeps a command running.
        with anyio.open_signal_receiver(*_STOP_SIGNALS) as signals:
            async for signum in signals:
                if not stopped_by:
                    stopped_by.append(int(signum))
                    with anyio.CancelScope(shield=True):
                        await table.close_all()
                userver.should_exit = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(guarded.reap_idle)
        tg.start_soon(stop_on_signal)
        try:
            await userver.serve(sockets=[sock])
        finally:
            tg.cancel_scope.cancel()


class SessionGuard:
    """ASGI wrapper in front of the SDK's streamable-HTTP app.

    Checks the bearer token; follows each MCP session's HTTP connections, so
    that a session whose client went away is closed after ``idle_timeout``, a
    DELETE closes it at once, and a tool call whose POST connection drops is
    cancelled (its command killed).
    """

    def __init__(self, app: Any, table: SessionTable, *, token: str, idle_timeout: float) -> None:
        self.app = app
        self.table = table
        self._token = token.encode("utf-8")
        self.idle_timeout = idle_timeout
        self._open: dict[str, int] = {}
        self._idle_since: dict[str, float] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _unauthorized(send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        sid = headers.get("mcp-session-id")
        method = scope.get("method", "")
        body = bytearray()
        finished = [False]
        new_sid: list[str] = []

        async def watch_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request" and len(body) <= _MAX_BODY:
                body.extend(message.get("body", b""))
            elif message["type"] == "http.disconnect" and not finished[0] and method == "POST":
                key = sid or (new_sid[0] if new_sid else None)
                if key is not None:
                    ids = _request_ids(bytes(body))
                    if ids and self.table.cancel_calls(key, ids):
                        log.info("client of session %s went away: cancelled its call(s) %s", key[:12], ids)
            return message

        async def watch_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                for k, v in message.get("headers", []):
                    if k.decode("latin-1").lower() == "mcp-session-id":
                        new_sid.append(v.decode("latin-1"))
                        self._enter(new_sid[0])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished[0] = True
            await send(message)

        if sid:
            self._enter(sid)
        try:
            await self.app(scope, watch_receive, watch_send)
        finally:
            for key in ([sid] if sid else []) + new_sid[:1]:
                self._leave(key)
            if method == "DELETE" and sid:
                await self.table.close(sid)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for k, v in scope.get("headers", []):
            if k.lower() == b"authorization":
                scheme, _, value = v.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), self._token)
        return False

    def _enter(self, sid: str) -> None:
        self._open[sid] = self._open.get(sid, 0) + 1
        self._idle_since.pop(sid, None)

    def _leave(self, sid: str) -> None:
        n = self._open.get(sid, 1) - 1
        if n > 0:
            self._open[sid] = n
        else:
            self._open.pop(sid, None)
            self._idle_since[sid] = time.monotonic()

    async def reap_idle(self) -> None:
        """Close the shells of sessions with no HTTP connection for ``idle_timeout`` (the SDK drops them too)."""
        every = min(max(self.idle_timeout / 4, 0.1), 30.0)
        while True:
            await anyio.sleep(every)
            now = time.monotonic()
            for sid, since in list(self._idle_since.items()):
                if sid not in self._open and now - since >= self.idle_timeout:
                    self._idle_since.pop(sid, None)
                    await self.table.close(sid)
            # Sessions the SDK never admitted (refused or failed opening requests) leave no shell behind.
            for key in self.table.keys():
                if key not in self._open and key not in self._idle_since:
                    self._idle_since[key] = now


def _request_ids(body: bytes) -> list[Any]:
    try:
        data = json.loads(body)
    except ValueError:
        return []
    items = data if isinstance(data, list) else [data]
    return [m["id"] for m in items if isinstance(m, dict) and "method" in m and "id" in m]


async def _unauthorized(send: Any) -> None:
    body = json.dumps({"error": "unauthorized", "error_description": "a valid bearer token is required"}).encode()
    await send({
        "type": "http.response.start",
        "status": 401,
        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="hermes-env"'),
                    (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "http.response.body", "body": body})

