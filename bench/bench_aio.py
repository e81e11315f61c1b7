"""asyncio vs threads on the same work: S local sessions x C commands each, in one process.

aio: ``hermes_env_core.aio``, one task per session, all sessions at once.
threads: the sync API, one ``ThreadPoolExecutor`` worker per session.
Rounds alternate; prints the median wall time of each (session creation
included, and separately the commands alone) and the ratio aio / threads.
Usage: python bench/bench_aio.py [--sessions 100] [--commands 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from hermes_env_core import create_environment
from hermes_env_core.aio import create_environment as acreate_environment

COMMAND = "echo $RANDOM"


def threads_round(sessions: int, commands: int) -> tuple[float, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=sessions) as pool:
        envs = list(pool.map(lambda _i: create_environment("local"), range(sessions)))
        ready = time.perf_counter()

        def work(env: object) -> int:
            ok = 0
            for _ in range(commands):
                ok += env.execute(COMMAND).exit_code == 0  # type: ignore[attr-defined]
            return ok

        done = sum(pool.map(work, envs))
        end = time.perf_counter()
        list(pool.map(lambda e: e.close(), envs))
    assert done == sessions * commands, f"threads: {done} of {sessions * commands} commands succeeded"
    return end - start, end - ready


async def aio_round_async(sessions: int, commands: int) -> tuple[float, float]:
    start = time.perf_counter()
    envs = await asyncio.gather(*(acreate_environment("local") for _ in range(sessions)))
    ready = time.perf_counter()

    async def work(env: object) -> int:
        ok = 0
        for _ in range(commands):
            ok += (await env.execute(COMMAND)).exit_code == 0  # type: ignore[attr-defined]
        return ok

    done = sum(await asyncio.gather(*(work(e) for e in envs)))
    end = time.perf_counter()
    await asyncio.gather(*(e.close() for e in envs))
    assert done == sessions * commands, f"aio: {done} of {sessions * commands} commands succeeded"
    return end - start, end - ready


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100, choices=range(1, 1001), metavar="1..1000")
    ap.add_argument("--commands", type=int, default=20, choices=range(1, 1001), metavar="1..1000")
    ap.add_argument("--rounds", type=int, default=3, choices=range(1, 21), metavar="1..20")
    args = ap.parse_args()
    s, c = args.sessions, args.commands
    # warm-up: imports, the plugin registry, the first bash
    threads_round(2, 2)
    asyncio.run(aio_round_async(2, 2))
    results: dict[str, list[tuple[float, float]]] = {"threads": [], "aio": []}
    for i in range(args.rounds):
        order = ["threads", "aio"] if i % 2 == 0 else ["aio", "threads"]
        for kind in order:
            r = threads_round(s, c) if kind == "threads" else asyncio.run(aio_round_async(s, c))
            results[kind].append(r)
            print(f"round {i + 1} {kind:7s}: total {r[0]:.2f} s, commands {r[1]:.2f} s", file=sys.stderr)
    med = {k: (statistics.median(t for t, _ in v), statistics.median(x for _, x in v)) for k, v in results.items()}
    n = s * c
    print(f"{s} local sessions x {c} commands = {n} commands, median of {args.rounds} rounds")
    for k in ("threads", "aio"):
        total, cmds = med[k]
        print(f"  {k:7s}: total {total:.2f} s, commands alone {cmds:.2f} s ({n / cmds:.0f} commands/s)")
    print(
        f"  ratio aio/threads: total {med['aio'][0] / med['threads'][0]:.2f}x, "
        f"commands {med['aio'][1] / med['threads'][1]:.2f}x (below 1 = asyncio faster)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
