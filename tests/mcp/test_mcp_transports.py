"""Transport-level behaviour of ``hermes-env mcp``: the token, isolated sessions, the session cap,
a client that disappears mid-command, an unavailable backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from tests.mcp.mcpsupport import (
    HttpServer,
    http_client,
    http_server,
    pid_alive,
    read_pid,
    server_env,
    stdio_client,
    wait_until,
)

pytestmark = pytest.mark.anyio

HERE = Path(__file__).resolve().parent
INIT = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}},
}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


async def run(client: Any, command: str) -> dict[str, Any]:
    r = await client.call_tool("run", {"command": command})
    assert not r.is_error, r.content
    return r.structured_content


async def test_http_requires_the_bearer_token(http_srv: HttpServer) -> None:
    async with httpx2.AsyncClient(timeout=10) as hc:
        missing = await hc.post(http_srv.url, json=INIT, headers=HEADERS)
        wrong = await hc.post(http_srv.url, json=INIT, headers={**HEADERS, "Authorization": "Bearer " + "x" * 43})
        right = await hc.post(http_srv.url, json=INIT, headers={**HEADERS, "Authorization": f"Bearer {http_srv.token}"})
    assert missing.status_code == 401 and wrong.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert right.status_code == 200 and right.headers.get("mcp-session-id")
    # The SDK client with a wrong token gets no session either.
    with pytest.raises(Exception) as info:
        async with http_client(http_srv, token="not-the-token-at-all"):
            pass
    assert "MCPError" in repr(info.value)


async def test_http_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("a-token-from-a-file-0123456789\n")
    token_file.chmod(0o600)
    with http_server(tmp_path, token_file=token_file) as srv:
        assert not any("bearer token:" in line for line in srv.stderr), "a token read from a file is not printed"
        async with http_client(srv) as c:
            assert (await run(c, "echo via file"))["output"] == "via file\n"


def test_http_token_file_must_hold_a_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("short\n")
    token_file.chmod(0o600)
    proc = subprocess.run(
        [sys.executable, "-m", "hermes_env_core.cli", "mcp", "--http", "127.0.0.1:0", "--token-file", str(token_file)],
        env=server_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert str(token_file) in proc.stderr and "at least 16 characters" in proc.stderr


async def test_two_concurrent_http_sessions_are_isolated(http_srv: HttpServer, tmp_path: Path) -> None:
    async with http_client(http_srv) as a, http_client(http_srv) as b:
        ra = await run(a, f"SECRET=alpha; cd {tmp_path}")
        rb = await run(b, "SECRET=beta; cd /")
        assert ra["task_id"] != rb["task_id"]
        # Both at once: each sees only its own state.
        results: dict[str, dict[str, Any]] = {}

        async def ask(name: str, client: Any) -> None:
            results[name] = await run(client, "sleep 0.3; echo $SECRET; pwd")

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "a", a)
            tg.start_soon(ask, "b", b)
        assert results["a"]["output"] == f"alpha\n{tmp_path}\n"
        assert results["b"]["output"] == "beta\n/\n"
        spawned = await a.call_tool("spawn", {"command": "sleep 60"})
        other = await b.call_tool("process_output", {"id": spawned.structured_content["id"]})
        assert other.is_error and "no background process" in other.content[0].text


async def test_two_concurrent_stdio_sessions_are_isolated(tmp_path: Path) -> None:
    async with stdio_client(tmp_path) as a, stdio_client(tmp_path) as b:
        ra = await run(a, "SECRET=alpha")
        rb = await run(b, "echo \"[$SECRET]\"")
        assert rb["output"] == "[]\n" and ra["task_id"] != rb["task_id"]
        assert (await run(a, "echo $SECRET"))["output"] == "alpha\n"


async def test_http_session_cap(tmp_path: Path) -> None:
    with http_server(tmp_path, "--max-sessions", "2") as srv:
        async with http_client(srv) as a, http_client(srv) as b:
            await run(a, "true")
            await run(b, "true")
            async with httpx2.AsyncClient(timeout=10) as hc:
                third = await hc.post(srv.url, json=INIT, headers={**HEADERS, "Authorization": f"Bearer {srv.token}"})
            assert third.status_code == 503
        # Closed sessions free their places.
        async with http_client(srv) as c:
            assert (await run(c, "echo again"))["output"] == "again\n"


def _client_process(tmp_path: Path, mode: str, pidfile: Path, srv: HttpServer | None = None) -> subprocess.Popen[bytes]:
    env = server_env(tmp_path)
    env["MCP_TMP"] = str(tmp_path)
    if srv is not None:
        env["MCP_URL"], env["MCP_TOKEN"] = srv.url, srv.token
    return subprocess.Popen([sys.executable, str(HERE / "client_script.py"), mode, str(pidfile)], env=env, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return out


def test_stdio_client_killed_mid_command(tmp_path: Path) -> None:
    pidfile = tmp_path / "cmd.pid"
    client = _client_process(tmp_path, "stdio", pidfile)
    try:
        wait_until(lambda: read_pid(pidfile) is not None or client.poll() is not None, what="the command to start")
        pid = read_pid(pidfile)
        assert pid is not None and pid_alive(pid), "the client died before its command started"
        servers = _children_of(client.pid)
        assert servers, "the stdio server is the client's child"
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        # The server sees its stdin close: it kills the command and exits by itself.
        wait_until(lambda: not pid_alive(pid), what=f"command pid {pid} to be killed")
        wait_until(lambda: not any(pid_alive(s) for s in servers), what="the stdio server to exit")
    finally:
        if client.poll() is None:
            client.kill()


def test_http_client_killed_mid_command(tmp_path: Path) -> None:
    pidfile = tmp_path / "cmd.pid"
    with http_server(tmp_path) as srv:
        client = _client_process(tmp_path, "http", pidfile, srv)
        try:
            wait_until(lambda: read_pid(pidfile) is not None or client.poll() is not None, what="the command to start")
            pid = read_pid(pidfile)
            assert pid is not None and pid_alive(pid), "the client died before its command started"
            client.send_signal(signal.SIGKILL)
            client.wait(10)
            wait_until(lambda: not pid_alive(pid), what=f"command pid {pid} to be killed")
            assert srv.proc.poll() is None, "the server survives"

            async def again() -> str:
                async with http_client(srv) as c:
                    return (await run(c, "echo next client"))["output"]

            assert anyio.run(again) == "next client\n"
        finally:
            if client.poll() is None:
                client.kill()


async def test_http_idle_session_is_closed(tmp_path: Path) -> None:
    with http_server(tmp_path, "--idle-timeout", "1") as srv:
        async with httpx2.AsyncClient(timeout=10) as hc:
            auth = {**HEADERS, "Authorization": f"Bearer {srv.token}"}
            init = await hc.post(srv.url, json=INIT, headers=auth)
            sid = init.headers["mcp-session-id"]
            auth |= {"mcp-session-id": sid, "mcp-protocol-version": "2025-06-18"}
            await hc.post(srv.url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=auth)
            r = await hc.post(srv.url, headers=auth, json={
                "jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "spawn", "arguments": {"command": "sleep 120"}},
            })
            assert r.status_code == 200, r.text
            pid = int(r.text.split('"pid":')[1].split(",")[0])
            assert pid_alive(pid)
            # No request, no stream: after the idle timeout the session and its environment go.
            with anyio.fail_after(30):
                while pid_alive(pid):
                    await anyio.sleep(0.1)
            gone = await hc.post(srv.url, json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, headers=auth)
            assert gone.status_code == 404


async def test_unavailable_backend_is_a_tool_error(tmp_path: Path) -> None:
    async with stdio_client(tmp_path, "--env", "no-such-backend") as c:
        r = await c.call_tool("run", {"command": "true"})
        assert r.is_error and "no-such-backend" in r.content[0].text
        r = await c.call_tool("read_file", {"path": "x"})
        assert r.is_error and "no-such-backend" in r.content[0].text


async def test_http_server_shutdown_closes_every_environment(tmp_path: Path) -> None:
    with http_server(tmp_path) as srv:
        async with http_client(srv) as a, http_client(srv) as b:
            pids = []
            for c in (a, b):
                r = await c.call_tool("spawn", {"command": "sleep 300"})
                pids.append(r.structured_content["pid"])
            assert all(pid_alive(p) for p in pids)
            srv.proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):
                while srv.proc.poll() is None:
                    await anyio.sleep(0.05)
        assert srv.proc.returncode == 128 + signal.SIGTERM  # as docker run: 128 + the signal
        assert not any(pid_alive(p) for p in pids), "background processes outlived the server"


async def test_stdio_server_terminated_closes_its_environment(tmp_path: Path) -> None:
    async with stdio_client(tmp_path) as c:
        r = await c.call_tool("spawn", {"command": "sleep 300"})
        pid = r.structured_content["pid"]
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in _children_of(os.getpid())}
        servers = [p for p, argv in cmdlines.items() if b"hermes_env_core.cli" in argv and b"--http" not in argv]
        assert len(servers) == 1, cmdlines
        os.kill(servers[0], signal.SIGTERM)
        with anyio.fail_after(30):
            while pid_alive(servers[0]) or pid_alive(pid):
                await anyio.sleep(0.05)
