"""Singularity backend overhead: ``execute('true')`` against a raw ``apptainer exec instance://NAME true``.

Both run in one process, interleaved, against the same instance of a small SIF
built from this host's binaries (or ``--image``). Target: median <= 1.3x raw.
Also printed: environment creation (instance start plus the session's first
snapshot) and close, against raw ``instance start`` / ``instance stop``.

    python plugins/hermes-env-singularity/bench/bench_singularity.py [-n 60] [--image X.sif]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from hermes_env_singularity.backend import SingularityEnvironment
from hermes_env_singularity.runtime import client_env, find_runtime


def build_image(tmp: Path) -> str:
    from singularity_support import build_rootfs

    root = build_rootfs(tmp / "rootfs")
    out = tmp / "bench.sif"
    proc = find_runtime().run(["build", str(out), str(root)], env=client_env(), timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"apptainer build failed: {proc.stderr[-1000:]}")
    return str(out)


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:7.1f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=60, help="iterations of each (default 60)")
    ap.add_argument("--image", help="a SIF to use instead of building one")
    ap.add_argument("--starts", type=int, default=5, help="environment create/close rounds (default 5)")
    args = ap.parse_args()
    runtime = find_runtime()
    with tempfile.TemporaryDirectory(prefix="hermes-bench-sing-") as tmp:
        image = args.image or build_image(Path(tmp))
        print(f"{runtime.version()} at {runtime.path}; image {image}; uid {os.getuid()}; "
              f"load {os.getloadavg()[0]:.2f}")

        env = SingularityEnvironment(image=image, timeout=60)
        try:
            env.execute("true")  # session snapshot, warm caches
            raw_argv = [runtime.path, "exec", f"instance://{env.instance_name}", "true"]
            # The backend's own flags and client environment, without the session wrapper.
            same_argv = [*env._exec_prefix, "true"]
            subprocess.run(raw_argv, capture_output=True, check=True)
            subprocess.run(same_argv, capture_output=True, check=True, env=env._exec_env)
            ours: list[float] = []
            raw: list[float] = []
            same: list[float] = []
            for _ in range(args.n):
                t0 = time.perf_counter()
                subprocess.run(raw_argv, capture_output=True)
                raw.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                subprocess.run(same_argv, capture_output=True, env=env._exec_env)
                same.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                r = env.execute("true")
                ours.append(time.perf_counter() - t0)
                assert r.exit_code == 0 and r.output == "", r
        finally:
            env.close()

        create: list[float] = []
        close: list[float] = []
        raw_start: list[float] = []
        raw_stop: list[float] = []
        cenv = client_env()
        for i in range(args.starts):
            t0 = time.perf_counter()
            e = SingularityEnvironment(image=image)
            e.execute("true")
            create.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            e.close()
            close.append(time.perf_counter() - t0)
            name = f"hermes-bench-raw-{os.getpid()}-{i}"
            t0 = time.perf_counter()
            runtime.run(["instance", "start", "--containall", "--no-home", "--writable-tmpfs", image, name], env=cenv)
            raw_start.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            runtime.run(["instance", "stop", "-t", "0", name], env=cenv)
            raw_stop.append(time.perf_counter() - t0)

    ratio = statistics.median(ours) / statistics.median(raw)
    print(f"execute('true')                      {ms(ours)}   (n={args.n})")
    print(f"raw apptainer exec instance:// true  {ms(raw)}")
    print(f"ratio                                {ratio:7.2f}x   target <= 1.30x  {'OK' if ratio <= 1.3 else 'MISSED'}")
    print(f"raw with the backend's flags         {ms(same)}   (-s exec --cleanenv --pwd /, filtered env; "
          f"wrapper cost {statistics.median(ours) / statistics.median(same):.2f}x)")
    print(f"create + first execute               {ms(create)}   (raw instance start {ms(raw_start).strip()})")
    print(f"close                                {ms(close)}   (raw instance stop -t 0 {ms(raw_stop).strip()})")
    return 0 if ratio <= 1.3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
