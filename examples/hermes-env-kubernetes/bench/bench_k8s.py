"""Per-command cost on one pod: ``execute('true')`` against a raw exec of ``true`` with the official client.

    python bench/bench_k8s.py [N]

The Kubernetes API emulator of the tests runs in its own process (so it does
not share this one's GIL); its pods are Docker containers. Both sides use the
same pod in the same run; medians and the ratio are printed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"

_SERVER = r"""
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
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    tmp = tempfile.mkdtemp(prefix="bench-k8s-")
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(TESTS), os.path.join(tmp, "kubeconfig")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdin is not None
    kubeconfig, image = server.stdout.readline().split()
    os.environ["KUBECONFIG"] = kubeconfig
    try:
        from kubernetes import client, config
        from kubernetes.stream import stream

        from hermes_env_kubernetes.backend import KubernetesEnvironment

        core = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        with KubernetesEnvironment(image=image, task_id="bench") as env:
            env.execute("true")  # pod up, session captured
            mode = getattr(env, "channel_mode", "process (this core has no resident channel)")
            pod, ns = env.pod_name, env.namespace

            def raw() -> None:
                stream(core.connect_get_namespaced_pod_exec, pod, ns, command=["true"],
                       stderr=True, stdin=False, stdout=True, tty=False)

            def ours() -> None:
                r = env.execute("true")
                assert r.exit_code == 0

            times: dict[str, list[float]] = {"raw": [], "execute": []}
            for _ in range(3):
                raw()
                ours()
            for _ in range(n):  # interleaved: both see the same machine load
                for name, fn in (("raw", raw), ("execute", ours)):
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
        raw_ms = statistics.median(times["raw"]) * 1000
        our_ms = statistics.median(times["execute"]) * 1000
        print(f"n={n} per side, same pod, same run; commands go by: {mode}")
        print(f"raw stream(connect_get_namespaced_pod_exec, ['true'])  median {raw_ms:7.2f} ms")
        print(f"execute('true')                                        median {our_ms:7.2f} ms")
        print(f"ratio execute/raw: {our_ms / raw_ms:.2f}x  (speed-up {raw_ms / our_ms:.2f}x)")
    finally:
        server.stdin.close()
        server.wait(30)


if __name__ == "__main__":
    main()
