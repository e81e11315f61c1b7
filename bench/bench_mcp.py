"""MCP ``run`` of ``true`` (stdio and streamable HTTP, official SDK client) vs ``execute('true')`` directly, in one run.

Rounds are interleaved so that load on the machine hits every variant alike.
Prints medians, 90th percentiles and the ratio to the direct call.
Usage: python bench/bench_mcp.py [--rounds N]   (needs: pip install -e '.[mcp]')
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from hermes_env_core.backends.local import LocalEnvironment

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    env["TERMINAL_ENV"] = "local"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start_http(tmp: str, token_file: str) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hermes_env_core.cli", "mcp", "--http", "127.0.0.1:0", "--token-file", token_file],
        env=_env(), cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline().decode()
        m = re.search(r"(http://\S+/mcp)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit("the HTTP server did not start")


async def bench(rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct execute": [], "mcp stdio run": [], "mcp http run": []}
    env = LocalEnvironment()
    env.execute("true")
    with tempfile.TemporaryDirectory() as tmp:
        token_file = os.path.join(tmp, "token")
        Path(token_file).write_text(secrets.token_urlsafe(32))
        proc, url = _start_http(tmp, token_file)
        headers = {"Authorization": f"Bearer {Path(token_file).read_text()}"}
        params = StdioServerParameters(command=sys.executable, args=["-m", "hermes_env_core.cli", "mcp"],
                                       env=_env(), cwd=tmp)
        try:
            async with Client(params) as stdio, httpx2.AsyncClient(headers=headers, timeout=60) as hc, \
                    Client(streamable_http_client(url, http_client=hc)) as http:
                for client in (stdio, http):  # warm up: environments opened, first commands run
                    for _ in range(3):
                        await client.call_tool("run", {"command": "true"})
                for _ in range(rounds):
                    t = time.perf_counter()
                    r = env.execute("true")
                    times["direct execute"].append(time.perf_counter() - t)
                    assert r.exit_code == 0
                    for name, client in (("mcp stdio run", stdio), ("mcp http run", http)):
                        t = time.perf_counter()
                        res = await client.call_tool("run", {"command": "true"})
                        times[name].append(time.perf_counter() - t)
                        assert not res.is_error and res.structured_content["exit_code"] == 0
        finally:
            env.close()
            proc.terminate()
            proc.wait(15)
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    times = anyio.run(bench, args.rounds)
    base = statistics.median(times["direct execute"])
    print(f"{'variant':<18} {'median ms':>10} {'p90 ms':>8} {'ratio':>7}   ({args.rounds} rounds, interleaved)")
    for name, xs in times.items():
        med = statistics.median(xs)
        p90 = sorted(xs)[int(len(xs) * 0.9) - 1]
        print(f"{name:<18} {med * 1000:>10.2f} {p90 * 1000:>8.2f} {med / base:>6.2f}x")
    print(f"MCP overhead per call: stdio {1000 * (statistics.median(times['mcp stdio run']) - base):.2f} ms, "
          f"http {1000 * (statistics.median(times['mcp http run']) - base):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
