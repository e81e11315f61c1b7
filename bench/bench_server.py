"""The session server against each backend's raw call, in one run.

For each backend: ``execute('true')`` through the session server, through one
process per command (``channel=False``, the state restored each time), and the
raw call, interleaved so that drift on the machine hits all alike. Then: a
session that sourced bash-completion and defined 1,000 variables and 100
functions against a fresh one (local, docker); p50/p99 of 1000 sequential
docker commands; 8 threads x 100 commands on one docker environment (they run
one at a time, as in one shell).

Targets (issue 22): local <= 1.0x subprocess.run(['bash', '-c', 'true']);
docker >= 20x faster than exec_run; ssh <= 1.0x paramiko exec_command;
a loaded session <= 1.2x a fresh one; docker p99 <= 3x p50.

Usage: python bench/bench_server.py [-n 100] [--only local,docker,ssh]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from _timing import interleave, timed  # bench/ is the script's own directory

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASH_COMPLETION = "/usr/share/bash-completion/bash_completion"


def report(title: str, med: dict[str, float], raw: str, target: str, ok: bool) -> None:
    base = med[raw]
    parts = "  ".join(f"{k} {v:7.2f} ms ({v / base:.2f}x)" for k, v in med.items())
    print(f"{title:<10} {parts}   target {target}: {'ok' if ok else 'MISSED'}")


LOAD = (
    'for i in $(seq 1 1000); do declare "hermes_bench_v$i=value-$i-$RANDOM"; done; '
    'for i in $(seq 1 100); do eval "hermes_bench_f$i() { echo \\"f$i \\$1\\"; local x=$i; return 0; }"; done'
)


def completion_case(make: Callable[[], object], n: int, prepare: Callable[[object], str]) -> tuple[float, float]:
    """(fresh session ms, loaded session ms) for execute('true'); loaded: bash-completion,
    1,000 variables and 100 functions."""
    fresh, loaded = make(), make()
    try:
        path = prepare(loaded)
        r = loaded.execute(f"source {path} && {LOAD}; declare -F | wc -l; compgen -v | wc -l")  # type: ignore[attr-defined]
        assert r.exit_code == 0, r.output
        funcs, variables = (int(x) for x in r.output.split())
        assert funcs > 150 and variables > 1000, r.output
        med = interleave(n, fresh=lambda: fresh.execute("true"), loaded=lambda: loaded.execute("true"))  # type: ignore[attr-defined]
    finally:
        fresh.close()  # type: ignore[attr-defined]
        loaded.close()  # type: ignore[attr-defined]
    return med["fresh"], med["loaded"]


def bench_local(n: int) -> None:
    from hermes_env_core.backends.local import LocalEnvironment

    with LocalEnvironment(channel=True) as ch, LocalEnvironment(channel=False) as pr:
        med = interleave(
            n,
            raw=lambda: subprocess.run(["bash", "-c", "true"], check=True),
            server=lambda: ch.execute("true"),
            process=lambda: pr.execute("true"),
        )
    report("local", med, "raw", "server <= 1.0x raw", med["server"] <= med["raw"])
    for channel in (True, False):
        f, l_ = completion_case(lambda: LocalEnvironment(channel=channel), n, lambda e: BASH_COMPLETION)
        mode = "server" if channel else "process"
        print(f"local loaded session ({mode}): fresh {f:.2f} ms, loaded {l_:.2f} ms, {l_ / f:.2f}x "
              f"(target <= 1.2x: {'ok' if l_ <= 1.2 * f else 'MISSED'})")


def bench_docker(n: int, seq: int, threads: int, per_thread: int) -> None:
    from hermes_env_core.backends.docker import DockerEnvironment
    from tests.support.docker_engine import ensure_engine, ensure_test_image

    client = ensure_engine()
    image = ensure_test_image(client)
    ch = DockerEnvironment(image=image, pull="never", channel=True)
    pr = DockerEnvironment(image=image, pull="never", channel=False)
    try:
        container = client.containers.get(ch.container_id)
        med = interleave(
            n,
            raw=lambda: container.exec_run(["true"]),
            server=lambda: ch.execute("true"),
            process=lambda: pr.execute("true"),
        )
        report("docker", med, "raw", "server >= 20x faster than raw", med["server"] * 20 <= med["raw"])

        lat = sorted(timed(lambda: ch.execute("true"), seq))
        p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99)]
        print(f"docker {seq} sequential execute('true'): p50 {p50 * 1000:.2f} ms, "
              f"p99 {p99 * 1000:.2f} ms ({p99 / p50:.2f}x p50, target <= 3x: {'ok' if p99 <= 3 * p50 else 'MISSED'}), "
              f"max {lat[-1] * 1000:.2f} ms")

        def worker() -> None:
            for _ in range(per_thread):
                assert ch.execute("true").exit_code == 0

        for env, mode in ((ch, "server"), (pr, "process")):
            ts = [threading.Thread(target=worker if env is ch else lambda: [pr.execute("true") for _ in range(per_thread)])
                  for _ in range(threads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            wall = time.perf_counter() - t0
            print(f"docker {threads} threads x {per_thread} execute('true') ({mode}): {wall:.2f} s, "
                  f"{threads * per_thread / wall:.0f} commands/s")
    finally:
        ch.close()
        pr.close()

    with open(BASH_COMPLETION, "rb") as f:
        text = f.read()

    def put(env: object) -> str:
        r = env.execute("cat >/tmp/bash_completion", stdin=text)  # type: ignore[attr-defined]
        assert r.exit_code == 0, r.output
        return "/tmp/bash_completion"

    for channel in (True, False):
        f_, l_ = completion_case(lambda: DockerEnvironment(image=image, pull="never", channel=channel), n, put)
        mode = "server" if channel else "process"
        print(f"docker loaded session ({mode}): fresh {f_:.2f} ms, loaded {l_:.2f} ms, {l_ / f_:.2f}x "
              f"(target <= 1.2x: {'ok' if l_ <= 1.2 * f_ else 'MISSED'})")


def bench_ssh(n: int) -> None:
    import socket

    import paramiko

    from hermes_env_core.backends.ssh import SSHEnvironment
    from tests.support.sshd import SshServer

    with SshServer() as server, tempfile.TemporaryDirectory() as tmp:
        sock = socket.create_connection((server.host, server.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = paramiko.Transport(sock)
        t.start_client(timeout=10)
        t.auth_publickey(server.user, paramiko.PKey.from_path(str(server.client_key_path)))

        def raw() -> None:
            chan = t.open_session()
            chan.exec_command("true")
            chan.recv_exit_status()
            chan.close()

        def make(channel: bool) -> SSHEnvironment:
            return SSHEnvironment(
                host=server.host, port=server.port, user=server.user, key_path=str(server.client_key_path),
                use_agent=False, known_hosts=str(Path(tmp) / "known_hosts"), channel=channel,
            )

        ch, pr = make(True), make(False)
        try:
            med = interleave(n, raw=raw, server=lambda: ch.execute("true"), process=lambda: pr.execute("true"))
        finally:
            ch.close()
            pr.close()
            t.close()
    report("ssh", med, "raw", "server <= 1.0x raw", med["server"] <= med["raw"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=100, help="calls per series (default 100)")
    ap.add_argument("--seq", type=int, default=1000, help="sequential docker commands for p50/p99")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--per-thread", type=int, default=100)
    ap.add_argument("--only", default="local,docker,ssh")
    args = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus")
    only = set(args.only.split(","))
    if "local" in only:
        bench_local(args.n)
    if "ssh" in only:
        bench_ssh(args.n)
    if "docker" in only:
        bench_docker(args.n, args.seq, args.threads, args.per_thread)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
