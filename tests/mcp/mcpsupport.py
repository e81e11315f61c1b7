"""Starting ``hermes-env mcp`` as a real process and talking to it with the official MCP SDK client."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

ROOT = Path(__file__).resolve().parents[2]


def server_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    env["TERMINAL_ENV"] = "local"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def server_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "hermes_env_core.cli", "mcp", *args]


@dataclass
class Events:
    """What the server sent besides results: log messages, in arrival order."""

    logs: list[Any] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)

    async def on_log(self, params: Any) -> None:
        self.logs.append(params)
        self.changed.set()
        self.changed = anyio.Event()

    def data(self, event: str) -> list[dict[str, Any]]:
        return [p.data for p in self.logs if isinstance(p.data, dict) and p.data.get("event") == event]

    async def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            while True:
                for p in self.logs:
                    if isinstance(p.data, dict) and pred(p.data):
                        return p.data
                await self.changed.wait()


@contextlib.asynccontextmanager
async def stdio_client(tmp: Path, *args: str, events: Events | None = None) -> AsyncIterator[Client]:
    params = StdioServerParameters(command=sys.executable, args=server_argv(*args)[1:], env=server_env(tmp), cwd=str(tmp))
    kw: dict[str, Any] = {"logging_callback": events.on_log} if events is not None else {}
    async with Client(params, **kw) as client:
        yield client


@dataclass
class HttpServer:
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    stderr: list[str]


@contextlib.contextmanager
def http_server(tmp: Path, *args: str, token_file: Path | None = None) -> Iterator[HttpServer]:
    argv = server_argv("--http", "127.0.0.1:0", *args)
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    proc = subprocess.Popen(argv, env=server_env(tmp), cwd=str(tmp), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            lines.append(raw.decode("utf-8", "replace"))
            text = "".join(lines)
            if "/mcp" in text and (token_file is not None or "bearer token:" in text):
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        if not ready.wait(30) or proc.poll() is not None:
            raise AssertionError(f"the HTTP server did not start: {''.join(lines)}")
        text = "".join(lines)
        url = re.search(r"(http://\S+/mcp)", text).group(1)  # type: ignore[union-attr]
        if token_file is not None:
            token = token_file.read_text().strip()
        else:
            token = re.search(r"bearer token: (\S+)", text).group(1)  # type: ignore[union-attr]
        yield HttpServer(proc, url, token, lines)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@contextlib.asynccontextmanager
async def http_client(server: HttpServer, *, token: str | None = None, events: Events | None = None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token if token is not None else server.token}"}
    kw: dict[str, Any] = {"logging_callback": events.on_log} if events is not None else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as hc:
        async with Client(streamable_http_client(server.url, http_client=hc), **kw) as client:
            yield client


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_until(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


async def await_until(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await anyio.sleep(delay)
        delay = min(delay * 2, 0.2)


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None
