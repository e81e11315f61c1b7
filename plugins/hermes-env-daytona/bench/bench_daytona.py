"""Daytona backend vs the SDK's raw calls for ``true``, in one run against the emulator.

All go through the same unmodified SDK, the same emulator (in a process of
its own, with ``--latency`` seconds added to each request, one way) and the
same sandbox; calls are interleaved so all see the same machine load. Prints
the medians and the ratios against two baselines: the raw
``sandbox.process.exec('true')`` (one request, which the backend no longer
uses for commands: a long command would ride on it), and the raw session
command the backend does use (start with ``run_async``, ask for the exit
status until it is there, read the logs).
Usage: python plugins/hermes-env-daytona/bench/bench_daytona.py [--rounds N] [--latency S]
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


def serve(latency: float) -> None:
    """Run the emulator until stdin closes (in its own process, so it shares no GIL with the client)."""
    with load_emulator().DaytonaEmulator() as emu:
        emu.latency = latency
        print(json.dumps({"api_url": emu.api_url, "api_key": emu.api_key}), flush=True)
        sys.stdin.read()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--latency", type=float, default=0.01, help="seconds added to each request (one way)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.latency)
        return 0
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

    from hermes_env_daytona.backend import DaytonaEnvironment

    from daytona import SessionExecuteRequest

    server = subprocess.Popen([sys.executable, __file__, "--serve", "--latency", str(args.latency)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        emu = json.loads(server.stdout.readline())
        env = DaytonaEnvironment(api_url=emu["api_url"], api_key=emu["api_key"], task_id=f"bench{os.getpid()}")
        env.execute("true")
        sandbox = env.sandbox  # the raw baseline runs in the very same sandbox, through the same client
        proc = sandbox.process
        proc.create_session("bench")

        def raw_session() -> None:
            cmd = proc.execute_session_command("bench", SessionExecuteRequest(command="true", run_async=True))
            while proc.get_session_command("bench", cmd.cmd_id).exit_code is None:
                pass
            proc.get_session_command_logs("bench", cmd.cmd_id)

        for _ in range(10):
            proc.exec("true")
            raw_session()
            env.execute("true")
        raw_t, sess_t, ours_t = [], [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            proc.exec("true")
            raw_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            raw_session()
            sess_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            env.execute("true")
            ours_t.append(time.perf_counter() - t)
        env.close()
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(30)
    raw, sess, ours = (statistics.median(x) for x in (raw_t, sess_t, ours_t))
    print(f"against the emulator ({args.latency * 1e3:g} ms each way per request), {args.rounds} interleaved rounds, medians:")
    print(f"  raw process.exec('true')               {raw * 1e3:7.2f} ms")
    print(f"  raw session command 'true'             {sess * 1e3:7.2f} ms  ({sess / raw:.2f}x the exec)")
    print(f"  execute('true')                        {ours * 1e3:7.2f} ms  ratio {ours / sess:.2f} to the session command, "
          f"{ours / raw:.2f} to the exec (target <= 1.3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
