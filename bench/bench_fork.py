"""``env.fork(4)`` on docker vs a raw ``docker commit`` + 4 x ``containers.run``, in one run.

The image is ~100 MB, built here with ``docker import`` (the test image's files and
a random ballast file; no registry). ``fork(4)`` is timed until the four sessions
are ready (server booted, state restored); the baseline only starts containers.
Prints medians and the ratio; the target is fork(4) <= 2 s.
Usage: python bench/bench_fork.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hermes_env_core.backends.docker import DockerEnvironment  # noqa: E402
from tests.support.docker_engine import ensure_engine, ensure_test_image  # noqa: E402

BENCH_IMAGE = "hermes-env-bench-100m:latest"
BALLAST = 45 << 20


def bench_image(client, base: str) -> str:
    """A ~100 MB single-layer image made with ``docker import``, built once."""
    try:
        return client.images.get(BENCH_IMAGE).tags[0]
    except Exception:  # noqa: BLE001 - not built yet
        pass
    holder = client.containers.create(base, ["true"])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rootfs.tar")
        try:
            with open(path, "wb") as f:
                for chunk in holder.export():
                    f.write(chunk)
        finally:
            holder.remove(force=True)
        blob = os.path.join(tmp, "ballast")
        with open(blob, "wb") as f:
            f.write(os.urandom(BALLAST))
        with tarfile.open(path, "a") as tar:
            tar.add(blob, arcname="opt/ballast.bin")
        client.api.import_image_from_file(path, repository=BENCH_IMAGE.split(":")[0], tag="latest")
    return BENCH_IMAGE


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    client = ensure_engine()
    image = bench_image(client, ensure_test_image(client))
    size = client.images.get(image).attrs["Size"]
    ours, raw = [], []
    env = DockerEnvironment(image=image, pull="never")
    try:
        env.execute("cd /workspace && head -c 1000000 /dev/urandom > data.bin && export RUN=1 && f() { echo f; }")
        for _ in range(args.rounds):
            t = time.perf_counter()
            forks = env.fork(4)
            ours.append(time.perf_counter() - t)
            try:
                assert [e.execute("echo $RUN; f").output for e in forks] == ["1\nf\n"] * 4
            finally:
                for e in forks:
                    e.close()
            # raw: the same engine work a fork needs at least, with the SDK's high-level calls
            t = time.perf_counter()
            container = client.containers.get(env.container_id)
            committed = container.commit(repository="hermes-env-bench-raw", tag="x")
            started = [
                client.containers.run(committed.id, ["sleep", "infinity"], detach=True, network_mode="none")
                for _ in range(4)
            ]
            raw.append(time.perf_counter() - t)
            for c in started:
                c.remove(force=True)
            client.images.remove("hermes-env-bench-raw:x")
    finally:
        env.close()
    mo, mr = statistics.median(ours), statistics.median(raw)
    print(f"image {image}: {size / 1e6:.0f} MB; {args.rounds} rounds")
    print(f"fork(4) ready          median {mo:.3f} s  (min {min(ours):.3f}, max {max(ours):.3f})")
    print(f"raw commit + 4 x run   median {mr:.3f} s  (min {min(raw):.3f}, max {max(raw):.3f})")
    print(f"ratio {mo / mr:.2f}x; target fork(4) <= 2 s: {'met' if mo <= 2.0 else 'NOT met'}")
    return 0 if mo <= 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
