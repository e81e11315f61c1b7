"""Daytona backend vs the SDK's raw ``sandbox.process.exec('true')``, in one run against the emulator.

Both go through the same unmodified SDK, the same emulator and the same
sandbox; calls are interleaved so both see the same machine load. Prints the
medians and the ratio (target <= 1.3), and, to show where the difference
goes, the raw exec of the session wrapper's script for ``true`` alone (what
any backend pays for session state, before this backend's own work).
Usage: python plugins/hermes-env-daytona/bench/bench_daytona.py [--rounds N]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

    from hermes_env_daytona.backend import DaytonaEnvironment

    with load_emulator().DaytonaEmulator() as emu:
        env = DaytonaEnvironment(api_url=emu.api_url, api_key=emu.api_key, task_id=f"bench{os.getpid()}")
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
    raw, wrap, ours = (statistics.median(x) for x in (raw_t, wrap_t, ours_t))
    print(f"against the emulator, {args.rounds} interleaved rounds, medians:")
    print(f"  raw process.exec('true')               {raw * 1e3:6.2f} ms")
    print(f"  raw process.exec(<wrapped 'true'>)     {wrap * 1e3:6.2f} ms  ({wrap / raw:.2f}x: session state alone)")
    print(f"  execute('true')                        {ours * 1e3:6.2f} ms  ratio {ours / raw:.2f} (target <= 1.3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
