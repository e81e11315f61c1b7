"""hermes-env mcp from a client not written in Python: the TypeScript SDK's (``@modelcontextprotocol/sdk``).

Runs where node is present; CI (scripts/test.sh) installs node, npm and the package, so there it always runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.mcp.mcpsupport import ROOT, HttpServer, server_env

TS = Path(__file__).resolve().parent / "ts"


@pytest.fixture(scope="module")
def node() -> str:
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI"):
            pytest.fail("node is not installed (scripts/test.sh installs it: apt-get install nodejs npm)")
        pytest.skip("node is not installed")
    if not (TS / "node_modules" / "@modelcontextprotocol" / "sdk").is_dir():
        npm = shutil.which("npm")
        assert npm is not None, "npm is needed to install @modelcontextprotocol/sdk"
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=TS, check=True, timeout=600)
    return node


def _check(out: dict[str, Any], workdir: Path) -> None:
    assert out["server"] == "hermes-env"
    assert "run" in out["tools"] and "process_wait" in out["tools"]
    assert out["second"]["output"] == f"from-typescript\n{workdir}\ndone\n"
    assert out["second"]["exit_code"] == 0
    assert out["bad"]["isError"] is True and "argument 'command'" in out["bad"]["text"]
    assert out["wait1"]["event"] == "match" and out["wait1"]["matches"][0]["line"] == "READY-TS"
    assert out["wait2"]["event"] == "exit" and out["wait2"]["exit_code"] == 4
    assert out["read"]["content"] == "typed\n"
    assert (workdir / "ts-file.txt").read_text() == "typed\n"
    events = {d["event"]: d for d in out["logs"]}
    assert events["match"]["line"] == "READY-TS"
    assert events["exit"]["exit_code"] == 4


def test_typescript_client_over_stdio(node: str, tmp_path: Path) -> None:
    proc = subprocess.run([node, str(TS / "client.mjs"), "stdio", sys.executable, str(tmp_path)],
                          env={**server_env(tmp_path), "PYTHONPATH": str(ROOT)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _check(json.loads(proc.stdout.strip().splitlines()[-1]), tmp_path)


def test_typescript_client_over_http(node: str, http_srv: HttpServer, tmp_path: Path) -> None:
    proc = subprocess.run([node, str(TS / "client.mjs"), "http", http_srv.url, str(tmp_path)],
                          env={**os.environ, "MCP_TOKEN": http_srv.token}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _check(json.loads(proc.stdout.strip().splitlines()[-1]), tmp_path)
