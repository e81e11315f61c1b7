"""Daytona: ``execute('true')`` on the session server against one raw SDK exec, in one run.

The emulator (in a process of its own, so it shares no GIL with the client) has
its latency knobs on: every request and every WebSocket message takes
``--latency`` seconds more (the network and the proxy, one way per round trip), session command
statuses and output tails come late. Both sides go through the same unmodified
SDK to the same sandbox; rounds are interleaved so that drift on the machine
hits both alike. Prints the medians and the ratio (target <= 1.0x).

Usage: python bench/bench_daytona_server.py [--rounds N] [--latency S]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_EMULATOR = Path(__file__).resolve().parent.parent / "plugins" / "hermes-env-daytona" / "tests" / "emulator"


def _load_emulator():  # noqa: ANN202 - a test helper package, loaded by path
    name = "hermes_env_daytona_tests_emulator"
    spec = importlib.util.spec_from_file_location(name, _EMULATOR / "__init__.py", submodule_search_locations=[str(_EMULATOR)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def serve(latency: float) -> None:
    """Run the emulator until stdin closes."""
    with _load_emulator().DaytonaEmulator() as emu:
        emu.latency = latency
        emu.exit_status_delay = 0.05
        emu.output_after_exit = 0.05
        print(json.dumps({"api_url": emu.api_url, "api_key": emu.api_key}), flush=True)
        sys.stdin.read()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--latency", type=float, default=0.01, help="seconds added to each request and to each message sent")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.latency)
        return 0
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    from hermes_env_daytona.backend import DaytonaEnvironment

    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--latency", str(args.latency)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert server.stdout is not None
        emu = json.loads(server.stdout.readline())
        env = DaytonaEnvironment(api_url=emu["api_url"], api_key=emu["api_key"], task_id=f"bench{os.getpid()}")
        assert env.session_mode == "server", env.session_mode
        env.execute("true")
        proc = env.sandbox.process  # the raw baseline: the same sandbox, through the same client
        for _ in range(10):
            proc.exec("true")
            env.execute("true")
        raw_t, ours_t = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            proc.exec("true")
            raw_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = env.execute("true")
            ours_t.append(time.perf_counter() - t)
            assert r.exit_code == 0
        env.close()
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(30)
    raw, ours = statistics.median(raw_t), statistics.median(ours_t)
    print(f"daytona emulator, {args.latency * 1e3:g} ms per request and per message sent, {args.rounds} interleaved rounds, medians:")
    print(f"  raw sandbox.process.exec('true')   {raw * 1e3:7.2f} ms")
    print(f"  execute('true') on the server      {ours * 1e3:7.2f} ms")
    print(f"  ratio {ours / raw:.2f}x (target <= 1.0x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
