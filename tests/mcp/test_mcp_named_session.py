"""``hermes-env mcp --session NAME``: the MCP client's shell is a named session, left running when it goes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mcp.mcpsupport import stdio_client

pytestmark = pytest.mark.anyio


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp / "state")}
    return subprocess.run([sys.executable, "-m", "hermes_env_core.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


async def test_mcp_serves_the_named_session_and_leaves_it_running(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert _cli(tmp_path, "run", "--session", "agent", "cd /usr && export FROM_CLI=1").returncode == 0
    async with stdio_client(tmp_path, "--session", "agent") as client:
        r = await client.call_tool("run", {"command": 'echo "$FROM_CLI $PWD"; export FROM_MCP=2'})
        assert not r.is_error, r.content
        assert r.structured_content["output"] == "1 /usr\n"
    after = _cli(tmp_path, "run", "--session", "agent", "echo $FROM_MCP")
    assert after.stdout == "2\n", after.stderr
    assert _cli(tmp_path, "sessions", "rm", "agent").returncode == 0
