"""SIGTERM, SIGHUP and SIGINT sent to ``hermes-env mcp`` stop the running tool call's command and exit 128+signal."""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.mcp.mcpsupport import http_server, server_argv, server_env, wait_until

SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


def _send(proc: subprocess.Popen[bytes], message: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()


def _sleep_running(pid: int, marker: str) -> list[psutil.Process]:
    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in tree:
        try:
            if p.cmdline() == ["sleep", marker]:
                return tree
        except psutil.Error:
            continue
    return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_stdio_server_stopped_mid_call_kills_the_command(tmp_path: Path, sig: signal.Signals) -> None:
    marker = f"{1000 + uuid.uuid4().int % 100000}.5"
    proc = subprocess.Popen(
        server_argv(), env=server_env(tmp_path), cwd=tmp_path,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    tree: list[psutil.Process] = []
    try:
        _send(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
        assert proc.stdout is not None and b'"id":1' in proc.stdout.readline().replace(b" ", b"")
        _send(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        _send(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                     "params": {"name": "run", "arguments": {"command": f"sleep {marker}; echo done"}}})
        try:
            wait_until(lambda: bool(tree.extend(_sleep_running(proc.pid, marker)) or tree), 90, "the sleep")
        except AssertionError:
            proc.kill()
            raise AssertionError(f"no sleep; server said {proc.communicate()}") from None
        proc.send_signal(sig)
        assert proc.wait(30) == 128 + sig
        assert not [p.pid for p in tree if _alive(p)], "the command outlived the MCP server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in tree:
            if _alive(p):
                p.kill()


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_http_server_stopped_mid_call_kills_the_command(tmp_path: Path, sig: signal.Signals) -> None:
    import httpx2

    marker = f"{1000 + uuid.uuid4().int % 100000}.5"
    tree: list[psutil.Process] = []
    with http_server(tmp_path) as srv:
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                   "Authorization": f"Bearer {srv.token}"}
        with httpx2.Client(timeout=httpx2.Timeout(30, read=300)) as hc:
            init = hc.post(srv.url, headers=headers, json={
                "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
            assert init.status_code == 200, init.text
            headers |= {"mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
            hc.post(srv.url, headers=headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
            with hc.stream("POST", srv.url, headers=headers, json={
                "jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "run", "arguments": {"command": f"sleep {marker}; echo done"}},
            }):
                wait_until(lambda: bool(tree.extend(_sleep_running(srv.proc.pid, marker)) or tree), 90, "the sleep")
                srv.proc.send_signal(sig)
                assert srv.proc.wait(30) == 128 + sig
        try:
            assert not [p.pid for p in tree if _alive(p)], "the command outlived the MCP server"
            assert f"stopped by {sig.name}" in "".join(srv.stderr)
        finally:
            for p in tree:
                if _alive(p):
                    p.kill()
