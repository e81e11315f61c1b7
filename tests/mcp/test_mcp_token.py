"""The HTTP server's bearer token: a token file must be private (as ssh wants its keys); or $HERMES_ENV_MCP_TOKEN."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from tests.mcp.mcpsupport import http_server, server_env

INIT = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}},
}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
TOKEN = "a-private-token-0123456789abcdef"


def _serve(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_env_core.cli", "mcp", "--http", "127.0.0.1:0", *args],
        env={**server_env(tmp_path), **env}, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_a_token_file_others_can_access_is_refused_with_the_fix(tmp_path, mode):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(mode)
    proc = _serve(tmp_path, "--token-file", str(token_file))
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()[-1:]
    assert str(token_file) in line and f"{mode:04o}" in line and f"chmod 600 {token_file}" in line, proc.stderr
    assert TOKEN not in proc.stderr


def test_a_private_token_file_is_accepted(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with http_server(tmp_path, token_file=token_file) as srv:
        r = httpx2.post(srv.url, json=INIT, headers={**HEADERS, "Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text


def _http_server_with_env_token(tmp_path: Path, token: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "hermes_env_core.cli", "mcp", "--http", "127.0.0.1:0"],
        env={**server_env(tmp_path), "HERMES_ENV_MCP_TOKEN": token}, cwd=tmp_path,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def test_the_token_can_come_from_the_environment_and_commands_do_not_see_it(tmp_path):
    proc = _http_server_with_env_token(tmp_path, TOKEN)
    try:
        assert proc.stderr is not None
        line = b""
        while b"/mcp" not in line:
            line = proc.stderr.readline()
            assert line, "the server ended before it served"
            assert b"bearer token:" not in line  # a token it was given is not printed
        url = line.decode().split(" at ")[-1].strip()
        bad = httpx2.post(url, json=INIT, headers={**HEADERS, "Authorization": "Bearer not-the-token-at-all"})
        assert bad.status_code == 401
        auth = {**HEADERS, "Authorization": f"Bearer {TOKEN}"}
        init = httpx2.post(url, json=INIT, headers=auth, timeout=30)
        assert init.status_code == 200, init.text
        auth |= {"mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
        httpx2.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=auth, timeout=30)
        r = httpx2.post(url, headers=auth, timeout=60, json={
            "jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "run", "arguments": {"command": 'echo "[${HERMES_ENV_MCP_TOKEN-unset}]"'}},
        })
        assert r.status_code == 200 and "[unset]" in r.text and TOKEN not in r.text, r.text
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_short_token_in_the_environment_is_refused(tmp_path):
    proc = _serve(tmp_path, HERMES_ENV_MCP_TOKEN="short")
    assert proc.returncode == 2 and "HERMES_ENV_MCP_TOKEN" in proc.stderr and "at least 16" in proc.stderr


def test_a_token_file_and_a_token_variable_together_are_refused(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    proc = _serve(tmp_path, "--token-file", str(token_file), HERMES_ENV_MCP_TOKEN=TOKEN)
    assert proc.returncode == 2 and "given twice" in proc.stderr
