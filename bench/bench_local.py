"""Local backend vs a raw ``subprocess.run(['bash', '-c', ...])``, in one run.

Prints medians and ratios for: ``execute('true')``; a 50 MB output (time and
peak RSS growth); bounded capture of ``yes`` for 3 s (RSS growth).
Usage: python bench/bench_local.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from _timing import timed  # bench/ is the script's own directory

BIG = "head -c 50000000 /dev/zero | tr '\\0' a"


def child(kind: str) -> dict:
    """Runs one memory measurement in a fresh interpreter (clean ru_maxrss)."""
    code = f"""
import json, resource, subprocess, time
from hermes_env_core.backends.local import LocalEnvironment
kind = {kind!r}
env = LocalEnvironment(max_output_bytes=64 * 1024 * 1024)
env.execute('true')
if kind == 'yes':
    env = LocalEnvironment()
    env.execute('true')
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
if kind == 'raw':
    out = subprocess.run(['bash', '-c', {BIG!r}], capture_output=True).stdout
    size = len(out)
elif kind == 'ours':
    r = env.execute({BIG!r})
    size = len(r.output)
else:
    r = env.execute('yes', timeout=3)
    size = len(r.output)
dt = time.perf_counter() - t
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"growth_kib": after - before, "size": size, "seconds": dt}}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--big-rounds", type=int, default=7)
    args = ap.parse_args()

    # Memory first, while this process is small: a child's ru_maxrss starts
    # at its parent's high-water mark on Linux (it is kept across exec).
    raw_mem = child("raw")
    our_mem = child("ours")
    yes = child("yes")

    from hermes_env_core.backends.local import LocalEnvironment

    env = LocalEnvironment()
    env.execute("true")
    raw_t, ours_t = [], []
    for _ in range(args.rounds):  # interleaved, so both see the same machine load
        raw_t += timed(lambda: subprocess.run(["bash", "-c", "true"], capture_output=True), 1)
        ours_t += timed(lambda: env.execute("true"), 1)
    raw, ours = statistics.median(raw_t), statistics.median(ours_t)
    print(f"execute('true'): raw {raw * 1e3:.3f} ms, hermes-env {ours * 1e3:.3f} ms, ratio {ours / raw:.2f} (target <= 1.5)")

    # What the per-command cgroup costs (its join through /bin/sh, mkdir, rmdir).
    from hermes_env_core.backends._local_tree import cgroup_pool

    if cgroup_pool() is not None:
        nocg = LocalEnvironment(cgroup=False)
        nocg.execute("true")
        with_t, without_t = [], []
        for _ in range(args.rounds):
            with_t += timed(lambda: env.execute("true"), 1)
            without_t += timed(lambda: nocg.execute("true"), 1)
        w, wo = statistics.median(with_t), statistics.median(without_t)
        print(f"execute('true'): cgroup per command {w * 1e3:.3f} ms, without {wo * 1e3:.3f} ms, ratio {w / wo:.2f}")
        nocg.close()
    else:
        print("execute('true'): no cgroup can be made here; commands run without one")

    big = LocalEnvironment(max_output_bytes=64 * 1024 * 1024)
    big.execute("true")
    braw, bours = [], []
    for _ in range(args.big_rounds):
        braw += timed(lambda: subprocess.run(["bash", "-c", BIG], capture_output=True), 1)
        bours += timed(lambda: big.execute(BIG), 1)
    r1, r2 = statistics.median(braw), statistics.median(bours)
    print(f"50 MB output: raw {r1 * 1e3:.1f} ms, hermes-env {r2 * 1e3:.1f} ms, ratio {r2 / r1:.2f} (target <= 1.3)")

    ratio = our_mem["growth_kib"] * 1024 / our_mem["size"]
    print(
        f"50 MB output peak RSS growth: raw {raw_mem['growth_kib'] / 1024:.0f} MiB, "
        f"hermes-env {our_mem['growth_kib'] / 1024:.0f} MiB = {ratio:.2f}x the captured size (target <= 3)"
    )
    print(f"`yes` for 3 s, bounded capture: RSS growth {yes['growth_kib'] / 1024:.1f} MiB (target <= 64)")
    env.close()
    big.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
