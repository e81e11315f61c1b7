"""Docker backend vs the raw docker SDK, in one run, on the same engine and container.

Prints medians and ratios for ``execute('true')`` vs ``container.exec_run(['true'])``
(interleaved, target <= 1.3x), and for creating an environment up to its first
command's result vs ``containers.run`` + ``exec_run``.
Usage: python bench/bench_docker.py [--rounds N] [--create-rounds M] [--image TAG]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hermes_env_core.backends.docker import DockerEnvironment  # noqa: E402
from tests.support.docker_engine import HARDENED_RUN_KWARGS, ensure_engine, ensure_test_image  # noqa: E402


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:7.1f} ms"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--create-rounds", type=int, default=10)
    ap.add_argument("--image", default=None)
    args = ap.parse_args()
    client = ensure_engine()
    image = args.image or ensure_test_image(client)

    # -- per command, the same container, interleaved so drift hits both equally
    env = DockerEnvironment(image=image, pull="never")
    try:
        container = client.containers.get(env.container_id)
        for _ in range(5):  # warm-up: session snapshots, connection pool
            env.execute("true")
            container.exec_run(["true"])
        ours, raw = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            r = env.execute("true")
            ours.append(time.perf_counter() - t)
            assert r.exit_code == 0
            t = time.perf_counter()
            container.exec_run(["true"])
            raw.append(time.perf_counter() - t)
    finally:
        env.close()
    ratio = statistics.median(ours) / statistics.median(raw)
    print(f"execute('true')          {ms(ours)}   raw exec_run(['true']) {ms(raw)}   ratio {ratio:.2f}x (target <= 1.3x)")

    # -- create to first result
    ours_c, raw_c = [], []
    for _ in range(args.create_rounds):
        t = time.perf_counter()
        env = DockerEnvironment(image=image, pull="never")
        env.execute("true")
        ours_c.append(time.perf_counter() - t)
        env.close()
        t = time.perf_counter()
        c = client.containers.run(image, ["sleep", "infinity"], detach=True, network_mode="none", init=True,
                                  **HARDENED_RUN_KWARGS)
        c.exec_run(["true"])
        raw_c.append(time.perf_counter() - t)
        c.remove(force=True)
    ratio_c = statistics.median(ours_c) / statistics.median(raw_c)
    print(f"create -> first result   {ms(ours_c)}   raw run + exec_run      {ms(raw_c)}   ratio {ratio_c:.2f}x")
    return 0 if ratio <= 1.3 else 1


if __name__ == "__main__":
    sys.exit(main())
