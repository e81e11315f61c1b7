"""Kubernetes: ``execute('true')`` on the session server against one raw exec stream, in one run.

The raw side is what one command costs without a session: the official
client's ``stream(connect_get_namespaced_pod_exec, ...)`` running ``true`` in
the same pod. The server side sends the command over the exec stream the
session already holds. The two are interleaved, so drift on the machine hits
both alike. The Kubernetes API emulator of the example's tests runs in its
own process (it does not share this one's GIL); its pods are Docker
containers. Target: the server at least 10x faster than the raw exec.

Usage: python bench/bench_kubernetes_server.py [-n 50]
(needs hermes-env-kubernetes[test] installed and a Docker engine)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "examples" / "hermes-env-kubernetes" / "tests"

_EMULATOR = r"""
import sys
sys.path.insert(0, sys.argv[1])
import conftest
d = conftest.docker_support()
client = d.ensure_engine()
image = d.ensure_test_image(client)
emu = conftest.load_emulator().KubeEmulator(client)
emu.start()
print(emu.write_kubeconfig(sys.argv[2]), image, flush=True)
sys.stdin.read()
emu.stop()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=50, help="timed commands per side (default 50)")
    n = parser.parse_args().n
    tmp = tempfile.mkdtemp(prefix="bench-k8s-server-")
    emulator = subprocess.Popen(
        [sys.executable, "-c", _EMULATOR, str(TESTS), os.path.join(tmp, "kubeconfig")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert emulator.stdout is not None and emulator.stdin is not None
    kubeconfig, image = emulator.stdout.readline().split()
    os.environ["KUBECONFIG"] = kubeconfig
    try:
        from kubernetes import client, config
        from kubernetes.stream import stream

        from hermes_env_kubernetes.backend import KubernetesEnvironment

        core = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        with KubernetesEnvironment(image=image, task_id="bench-server") as env:
            assert env.execute("true").exit_code == 0  # pod up, server booted
            assert env.session_mode == "server", env.session_mode
            pod, ns = env.pod_name, env.namespace

            def raw() -> None:
                out = stream(core.connect_get_namespaced_pod_exec, pod, ns, command=["true"],
                             stderr=True, stdin=False, stdout=True, tty=False)
                assert out == "", out

            def server() -> None:
                r = env.execute("true")
                assert r.exit_code == 0 and r.output == "", r

            sides: dict[str, Callable[[], None]] = {"raw": raw, "server": server}
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(3):  # warm-up
                for fn in sides.values():
                    fn()
            for _ in range(n):
                for name, fn in sides.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
        raw_ms = statistics.median(times["raw"]) * 1000
        srv_ms = statistics.median(times["server"]) * 1000
        print(f"kubernetes (API emulator, pods as Docker containers), n={n} per side, same pod, same run")
        print(f"raw stream(connect_get_namespaced_pod_exec, ['true'])   median {raw_ms:8.2f} ms")
        print(f"execute('true') on the session server                  median {srv_ms:8.2f} ms")
        print(f"server is {raw_ms / srv_ms:.1f}x faster than one raw exec (target >= 10x)")
    finally:
        emulator.stdin.close()
        emulator.wait(30)


if __name__ == "__main__":
    main()
