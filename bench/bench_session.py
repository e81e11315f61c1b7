"""What the session wrapper costs per command on the local backend, in one run.

Interleaves a raw ``bash -c true`` (the floor), ``execute('true')`` in a
session carrying some state, and the same under ``set -x`` (the wrapper then
runs the command as bash's own script, one more exec of bash). Prints medians
and ratios to the raw call.
Usage: python bench/bench_session.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hermes_env_core.backends.local import LocalEnvironment  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    plain = LocalEnvironment(channel=False)
    traced = LocalEnvironment(channel=False)
    setup = "for i in $(seq 40); do export V$i=value$i; done; f() { echo f; }; alias ll='ls -l'; cd /tmp"
    for env in (plain, traced):
        env.execute(setup)
    traced.execute("set -x")
    raw: list[float] = []
    wrapped: list[float] = []
    xtrace: list[float] = []
    try:
        for _ in range(args.rounds):
            t = time.perf_counter()
            subprocess.run(["bash", "-c", "true"], check=True)
            raw.append(time.perf_counter() - t)
            t = time.perf_counter()
            plain.execute("true")
            wrapped.append(time.perf_counter() - t)
            t = time.perf_counter()
            traced.execute("true")
            xtrace.append(time.perf_counter() - t)
    finally:
        plain.close()
        traced.close()
    base = statistics.median(raw)
    for name, values in (("raw bash -c true", raw), ("execute('true')", wrapped), ("execute under set -x", xtrace)):
        m = statistics.median(values)
        print(f"{name:24s} {m * 1000:7.2f} ms  x{m / base:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
