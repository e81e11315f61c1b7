"""Daytona backend vs the SDK's raw ``sandbox.process.exec('true')``, in one run against the emulator.

Both go through the same unmodified SDK, the same emulator (in a process of
its own) and the same sandbox; calls are interleaved so both see the same
machine load. Prints the
medians and the ratio (target <= 1.3), and, to show where the difference
goes, the raw exec of the session wrapper's script for ``true`` alone (what
any backend pays for session state, before this backend's own work).
Usage: python plugins/hermes-env-daytona/bench/bench_daytona.py [--rounds N]
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


def load_emulator():
    pkg_dir = Path(__file__).resolve().parent.parent / "tests" / "emulator"
    name = "hermes_env_daytona_tests_emulator"
    spec = importlib.util.spec_from_file_location(name, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def serve() -> None:
    """Run the emulator until stdin closes (in its own process, so it shares no GIL with the client)."""
    with load_emulator().DaytonaEmulator() as emu:
        print(json.dumps({"api_url": emu.api_url, "api_key": emu.api_key}), flush=True)
        sys.stdin.read()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve()
        return 0
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

    from hermes_env_daytona.backend import DaytonaEnvironment

    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        emu = json.loads(server.stdout.readline())
        env = DaytonaEnvironment(api_url=emu["api_url"], api_key=emu["api_key"], task_id=f"bench{os.getpid()}")
        env.execute("true")
        sandbox = env.sandbox  # the raw baseline runs in the very same sandbox, through the same client
        for _ in range(20):
            sandbox.process.exec("true")
            env.execute("true")
        raw_t, wrap_t, ours_t = [], [], []
        session = env.session
        for _ in range(args.rounds):
            t = time.perf_counter()
            sandbox.process.exec("true")
            raw_t.append(time.perf_counter() - t)
            wrapped = session.wrap("true")
            t = time.perf_counter()
            sandbox.process.exec(wrapped.script)
            wrap_t.append(time.perf_counter() - t)
            session.release(wrapped)
            t = time.perf_counter()
            env.execute("true")
            ours_t.append(time.perf_counter() - t)
        env.close()
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(30)
    raw, wrap, ours = (statistics.median(x) for x in (raw_t, wrap_t, ours_t))
    print(f"against the emulator, {args.rounds} interleaved rounds, medians:")
    print(f"  raw process.exec('true')               {raw * 1e3:6.2f} ms")
    print(f"  raw process.exec(<wrapped 'true'>)     {wrap * 1e3:6.2f} ms  ({wrap / raw:.2f}x: session state alone)")
    print(f"  execute('true')                        {ours * 1e3:6.2f} ms  ratio {ours / raw:.2f} (target <= 1.3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
