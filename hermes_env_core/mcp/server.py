"""The MCP server: tool calls mapped onto one ``McpShell`` per MCP session, on the official ``mcp`` SDK.

Over stdio the connection is the session. Over streamable HTTP each
``Mcp-Session-Id`` gets its own shell, closed when the session ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import mcp_types as types
from mcp.server.lowlevel.server import Server
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from .. import __version__
from ..errors import HermesEnvError
from ..processes import Notification, NotificationKind
from .session import McpShell, ToolError
from .tools import TOOLS, check_arguments

__all__ = ["SessionTable", "build_server"]

log = logging.getLogger("hermes_env_core.mcp")

STDIO_KEY = "stdio"
_PROGRESS_EVERY_S = 0.25
_PROGRESS_TAIL_CHARS = 8192
_SESSION_HEADER = "mcp-session-id"

INSTRUCTIONS = (
    "hermes-env gives you one long-lived bash shell per MCP session, in the environment this server was "
    "started with (local, docker, ssh, ...). `run` executes a command; state (variables, functions, cwd) "
    "carries over to the next `run`. Use `spawn` for servers and other long-running processes, then "
    "process_wait / process_output / process_kill. read_file and write_file work inside the environment."
)


@dataclass
class _Entry:
    shell: McpShell
    notify: Any = None  # the latest ServerSession of this MCP session: where background events go
    protocol_version: str = ""
    calls: dict[Any, tuple[threading.Event, McpShell]] = field(default_factory=dict)


class SessionTable:
    """The shells of the live MCP sessions, by session key (the stdio connection, or an HTTP session id)."""

    def __init__(self, opener_factory: Callable[[], Callable[[], Any]]) -> None:
        self._opener_factory = opener_factory
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._events_send: Any = None
        self._token: Any = None
        self.limiter = anyio.CapacityLimiter(256)

    # -- the event pump: background notifications from registry threads to MCP clients ----
    async def run(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        send, receive = anyio.create_memory_object_stream[tuple[str, str, dict[str, Any]]](1024)
        self._events_send = send
        self._token = anyio.lowlevel.current_token()
        task_status.started()
        async with receive:
            async for key, level, data in receive:
                with self._lock:
                    entry = self._entries.get(key)
                if entry is None or entry.notify is None:
                    continue
                if entry.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
                    continue  # 2026-07-28 has no session-wide log channel; process_wait reports the same
                await _send_log(entry, level, data)

    def post(self, key: str, level: str, data: dict[str, Any]) -> None:
        """From any thread: send ``data`` to session ``key``'s client as a log message (best effort)."""
        send, token = self._events_send, self._token
        if send is None:
            return
        try:
            anyio.from_thread.run_sync(send.send_nowait, (key, level, data), token=token)
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError, RuntimeError):
            log.debug("dropped event %s for session %s", data, key)

    def _event(self, key: str, note: Notification) -> None:
        entry = self.get(key)
        level, data = _describe(note)
        data["task_id"] = entry.shell.task_id if entry is not None else None
        self.post(key, level, data)

    # -- sessions ----------------------------------------------------------------------------
    def shell(self, key: str) -> _Entry:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                opener = self._opener_factory()
                entry = _Entry(McpShell(opener, on_event=lambda note: self._event(key, note)))
                self._entries[key] = entry
            return entry

    def get(self, key: str) -> _Entry | None:
        with self._lock:
            return self._entries.get(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    async def close(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            return
        for cancel, _ in list(entry.calls.values()):
            cancel.set()
        entry.shell.wake()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(entry.shell.close, limiter=self.limiter)

    async def close_all(self) -> None:
        for key in self.keys():
            await self.close(key)

    def cancel_calls(self, key: str, request_ids: list[Any]) -> int:
        """Cancel the named in-flight calls of session ``key`` (its client went away); how many."""
        entry = self.get(key)
        if entry is None:
            return 0
        n = 0
        for rid in request_ids:
            call = entry.calls.get(rid)
            if call is not None:
                call[0].set()
                call[1].wake()
                n += 1
        return n


def _describe(note: Notification) -> tuple[str, dict[str, Any]]:
    level = "info"
    data: dict[str, Any] = {"event": note.kind.value, "process_id": note.process_id, "command": note.command}
    if note.kind is NotificationKind.MATCH:
        data.update(pattern=note.pattern, line=note.text, suppressed=note.suppressed)
    elif note.kind is NotificationKind.EXIT:
        data.update(status=note.status, exit_code=note.exit_code, tail=note.text[-1000:])
        if note.exit_code != 0:
            level = "warning"
    else:
        data.update(message=note.text, status=note.status)
        level = "warning"
    data["text"] = str(note)
    return level, data


async def _send_log(entry: _Entry, level: str, data: dict[str, Any]) -> None:
    notification = types.LoggingMessageNotification(
        params=types.LoggingMessageNotificationParams(level=level, data=data, logger="hermes-env")  # type: ignore[arg-type]
    )
    try:
        await entry.notify.send_notification(notification)
    except Exception as exc:  # noqa: BLE001 - advisory: the client may be gone
        log.debug("could not send a log message: %r", exc)


# -- tool calls -------------------------------------------------------------------------------



async def _in_thread(fn: Callable[[], dict[str, Any]], cancel: threading.Event, shell: McpShell,
                     limiter: anyio.CapacityLimiter) -> dict[str, Any]:
    """Run ``fn`` in a worker thread; a cancelled request sets ``cancel`` and waits for ``fn`` to notice."""
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, outside the task group
            outcome.append((False, exc))

    async with anyio.create_task_group() as tg:

        async def on_cancel() -> None:
            try:
                await anyio.sleep_forever()
            finally:
                cancel.set()
                shell.wake()

        tg.start_soon(on_cancel)
        try:
            await anyio.to_thread.run_sync(call, limiter=limiter)
        finally:
            tg.cancel_scope.cancel()
    ok, value = outcome[0]
    if not ok:
        raise value
    result: dict[str, Any] = value
    return result


def _progress_token(ctx: Any) -> Any:
    meta = getattr(ctx, "meta", None)
    if not isinstance(meta, dict):
        return None
    return meta.get("progress_token", meta.get("progressToken"))


async def _tool_run(ctx: Any, entry: _Entry, args: dict[str, Any], cancel: threading.Event,
                    limiter: anyio.CapacityLimiter, post: Callable[[str, dict[str, Any]], None]) -> dict[str, Any]:
    chunks: list[str] = []
    size = [0]
    lock = threading.Lock()

    def on_output(text: str) -> None:
        with lock:
            chunks.append(text)
            size[0] += len(text.encode("utf-8", "replace"))
            if len(chunks) > 256:  # keep the tail only: progress carries the last few KB
                joined = "".join(chunks)[-_PROGRESS_TAIL_CHARS:]
                chunks[:] = [joined]

    def work() -> dict[str, Any]:
        result = entry.shell.run(
            args["command"], cwd=args.get("cwd"), timeout=args.get("timeout"), stdin=args.get("stdin"),
            cancel=cancel, on_output=on_output,
        )
        if cancel.is_set() and result["interrupted"]:
            # A cancelled request gets no response (the protocol says so); its outcome goes to the log.
            post(
                "notice",
                {"event": "cancelled", "command": args["command"], "exit_code": result["exit_code"],
                 "output": result["output"][-_PROGRESS_TAIL_CHARS:], "task_id": result["task_id"],
                 "text": f"run cancelled: exit code {result['exit_code']}"},
            )
        return result

    if _progress_token(ctx) is None:
        return await _in_thread(work, cancel, entry.shell, limiter)

    result: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:

        async def progress() -> None:
            sent = 0
            while True:
                await anyio.sleep(_PROGRESS_EVERY_S)
                with lock:
                    n = size[0]
                    tail = "".join(chunks)[-_PROGRESS_TAIL_CHARS:]
                if n > sent:
                    sent = n
                    try:
                        await ctx.session.report_progress(float(n), None, tail)
                    except Exception as exc:  # noqa: BLE001 - progress is advisory; the command goes on
                        log.debug("progress not sent: %r", exc)
                        return

        tg.start_soon(progress)
        try:
            result = await _in_thread(work, cancel, entry.shell, limiter)
        finally:
            tg.cancel_scope.cancel()
    return result


def _sync(method: str) -> Callable[..., Any]:
    def call(shell: McpShell, args: dict[str, Any], cancel: threading.Event) -> dict[str, Any]:
        if method == "spawn":
            return shell.spawn(args["command"], cwd=args.get("cwd"), watch=args.get("watch"),
                               watch_regex=args.get("watch_regex"), pty=bool(args.get("pty", False)))
        if method == "process_output":
            kw: dict[str, Any] = {k: args[k] for k in ("since", "max_bytes") if k in args}
            return shell.process_output(args["id"], **kw)
        if method == "process_wait":
            return shell.process_wait(args["id"], timeout=float(args.get("timeout", 30.0)), cancel=cancel)
        if method == "process_kill":
            return shell.process_kill(args["id"], signal=args.get("signal"))
        if method == "process_list":
            return shell.process_list()
        if method == "process_write":
            return shell.process_write(args["id"], args["data"], close_stdin=bool(args.get("close_stdin", False)))
        if method == "read_file":
            kw = {k: args[k] for k in ("offset", "max_bytes") if k in args}
            return shell.read_file(args["path"], **kw)
        if method == "write_file":
            return shell.write_file(args["path"], args["content"], encoding=args.get("encoding", "utf-8"),
                                    append=bool(args.get("append", False)), make_dirs=bool(args.get("make_dirs", False)))
        raise ToolError(f"unknown tool {method!r}")  # pragma: no cover - names come from TOOLS

    return call


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


def _ok(result: dict[str, Any]) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(result, ensure_ascii=False))],
        structured_content=result,
    )


def session_key(ctx: Any, *, http: bool) -> str | None:
    """Which MCP session a request belongs to: the stdio connection, or the HTTP session id (None: none)."""
    if not http:
        return STDIO_KEY
    request = getattr(ctx, "request", None)
    headers = getattr(request, "headers", None)
    if headers is None:
        return None
    key = headers.get(_SESSION_HEADER)
    return None if key is None else str(key)


def build_server(table: SessionTable, *, http: bool) -> Server[Any]:
    """The low-level MCP server; its lifespan runs ``table``'s event pump and closes every shell at the end."""

    @contextlib.asynccontextmanager
    async def lifespan(_server: Server[Any]) -> AsyncIterator[SessionTable]:
        async with anyio.create_task_group() as tg:
            await tg.start(table.run)
            try:
                yield table
            finally:
                await table.close_all()
                tg.cancel_scope.cancel()

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=t.name,
                    title=t.title,
                    description=t.description,
                    input_schema=t.input,
                    output_schema=t.output,
                    annotations=types.ToolAnnotations(
                        title=t.title, read_only_hint=t.read_only, destructive_hint=not t.read_only,
                        open_world_hint=False,
                    ),
                )
                for t in TOOLS.values()
            ]
        )

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        spec = TOOLS.get(params.name)
        if spec is None:
            return _error(f"unknown tool {params.name!r}; the tools are {', '.join(TOOLS)}")
        args = dict(params.arguments or {})
        problem = check_arguments(spec, args)
        if problem is not None:
            return _error(problem)
        key = session_key(ctx, http=http)
        if key is None:
            return _error(
                "hermes-env keeps one shell per MCP session, and this request belongs to none: connect with a "
                f"session (protocol revisions {', '.join(HANDSHAKE_PROTOCOL_VERSIONS)} over HTTP)"
            )
        entry = table.shell(key)
        entry.notify = ctx.session
        entry.protocol_version = ctx.protocol_version
        cancel = threading.Event()
        rid = ctx.request_id
        entry.calls[rid] = (cancel, entry.shell)
        try:
            if spec.name == "run":
                result = await _tool_run(ctx, entry, args, cancel, table.limiter,
                                         lambda level, data: table.post(key, level, data))
            else:
                fn = _sync(spec.name)
                result = await _in_thread(lambda: fn(entry.shell, args, cancel), cancel, entry.shell, table.limiter)
        except (ToolError, HermesEnvError, ValueError, TimeoutError) as exc:
            return _error(f"{spec.name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a tool error, never a crashed server
            log.exception("tool %s failed", spec.name)
            return _error(f"{spec.name} failed: {type(exc).__name__}: {exc}")
        finally:
            entry.calls.pop(rid, None)
        return _ok(result)

    async def discover(ctx: Any, params: Any) -> types.DiscoverResult:
        # A shell lives as long as its MCP session. The 2026-07-28 revision has no session over HTTP and
        # no session-wide channel for background events: advertise the handshake revisions only, so that
        # clients fall back to initialize, on both transports alike.
        return types.DiscoverResult(
            supported_versions=list(HANDSHAKE_PROTOCOL_VERSIONS),
            capabilities=server.get_capabilities(),
            instructions=INSTRUCTIONS,
        )

    server: Server[Any] = Server(
        "hermes-env",
        version=__version__,
        title="hermes-env shell",
        instructions=INSTRUCTIONS,
        lifespan=lifespan,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )
    server.add_request_handler("server/discover", types.RequestParams, discover)
    return server

