"""Background processes: exit-to-notification latency, and output throughput into a watched buffer.

Latency: a process prints ``$EPOCHREALTIME`` as its last act; the figure is
the notification's timestamp minus that (same clock: local, a container, a
local sshd). Targets: median <= 100 ms local, <= 500 ms docker and ssh. Runs
with the default poll settings (50 ms first wait, doubling to 2 s), for a
short process and for one that ran long enough for the polls to back off.

Throughput: 100 MB of log lines written into a watched rolling buffer, against
the same command writing to /dev/null, in the same run.

    python bench/bench_processes.py [-n 20] [--mb 100] [--skip-docker] [--skip-ssh]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.processes import NotificationKind, ProcessRegistry

LINE = "2026-01-01T00:00:00Z INFO request served in 12ms path=/api/items"  # 66 bytes + newline


def exit_latency(env: BaseEnvironment, n: int, *, runtime: float, detached: bool = False) -> list[float]:
    """Seconds from the process's last instruction to its EXIT notification, ``n`` runs."""
    lags = []
    with ProcessRegistry() as reg:
        for _ in range(n):
            p = reg.spawn(env, f'sleep {runtime}; printf %s "$EPOCHREALTIME"', detached=detached)
            while True:
                note = reg.next_notification(runtime + 30)
                if note is None:
                    raise RuntimeError(f"no exit notification for {p}")
                if note.kind is NotificationKind.EXIT and note.process_id == p.id:
                    break
            lags.append(note.time - float(note.text))
    return lags


def throughput(env: BaseEnvironment, mb: int, *, watch: str | None, detached: bool = False) -> tuple[float, int]:
    """Seconds for ``mb`` MB of lines through a background process (watched when ``watch``); matches seen."""
    cmd = f"yes '{LINE}' | head -c {mb * 1_000_000}; echo; echo DONE-MARKER"
    with ProcessRegistry() as reg:
        t0 = time.perf_counter()
        p = reg.spawn(env, cmd, watch=watch, detached=detached)
        code = p.wait(600)
        elapsed = time.perf_counter() - t0
        assert code == 0, (code, p.tail(300))
        assert p.output_end == mb * 1_000_000 + len("\nDONE-MARKER\n"), p.output_end
        return elapsed, p.watch_stats[0]


def devnull_baseline(mb: int, runs: int = 3) -> float:
    cmd = f"yes '{LINE}' | head -c {mb * 1_000_000} >/dev/null; echo; echo DONE-MARKER"
    best = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(["bash", "-c", cmd], stdout=subprocess.DEVNULL, check=True)
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def report(name: str, lags: list[float], target_ms: float) -> None:
    med = statistics.median(lags) * 1000
    p90 = sorted(lags)[int(len(lags) * 0.9) - 1] * 1000 if len(lags) >= 10 else max(lags) * 1000
    ok = "ok" if med <= target_ms else "MISSED"
    print(f"  {name:<38} median {med:7.1f} ms   p90 {p90:7.1f} ms   max {max(lags) * 1000:7.1f} ms"
          f"   (target <= {target_ms:.0f} ms: {ok})")


def with_docker(fn: Callable[[BaseEnvironment], None]) -> None:
    try:
        from hermes_env_core.backends.docker import DockerEnvironment
        from tests.support.docker_engine import ensure_engine, ensure_test_image

        image = ensure_test_image(ensure_engine())
    except BaseException as exc:  # noqa: BLE001 - pytest.skip raises a BaseException
        print(f"  docker: not available here ({exc})")
        return
    with DockerEnvironment(image=image) as env:
        fn(env)


def with_ssh(fn: Callable[[BaseEnvironment], None]) -> None:
    try:
        from hermes_env_core.backends.ssh import SSHEnvironment
        from tests.support.sshd import SshServer

        server = SshServer().start()
    except BaseException as exc:  # noqa: BLE001
        print(f"  ssh: not available here ({exc})")
        return
    try:
        with tempfile.TemporaryDirectory() as tmp, SSHEnvironment(
            host=server.host, port=server.port, user=server.user, key_path=str(server.client_key_path),
            use_agent=False, look_for_keys=False, known_hosts=f"{tmp}/known_hosts",
        ) as env:
            fn(env)
    finally:
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20, help="runs per latency figure")
    ap.add_argument("--mb", type=int, default=100, help="megabytes written for the throughput figures")
    ap.add_argument("--skip-docker", action="store_true")
    ap.add_argument("--skip-ssh", action="store_true")
    args = ap.parse_args()

    print("exit -> notification (default poll settings)")
    with LocalEnvironment() as env:
        env.execute("true")
        report("local child, 0.2 s process", exit_latency(env, args.n, runtime=0.2), 100)
        report("local detached (file + polls), 0.2 s", exit_latency(env, args.n, runtime=0.2, detached=True), 500)
        report("local detached, 3 s process (backed off)", exit_latency(env, max(3, args.n // 4), runtime=3, detached=True), 500)

    def remote(label: str) -> Callable[[BaseEnvironment], None]:
        def run(env: BaseEnvironment) -> None:
            env.execute("true")
            report(f"{label}, 0.2 s process", exit_latency(env, args.n, runtime=0.2), 500)
            report(f"{label}, 3 s process (backed off)", exit_latency(env, max(3, args.n // 4), runtime=3), 500)
            secs, _ = throughput(env, min(args.mb, 50), watch="ERROR")
            print(f"  {label}: {min(args.mb, 50)} MB through the log file and polls: {min(args.mb, 50) / secs:7.1f} MB/s")

        return run

    if not args.skip_docker:
        with_docker(remote("docker"))
    if not args.skip_ssh:
        with_ssh(remote("ssh"))

    print(f"\nthroughput: {args.mb} MB of {len(LINE) + 1}-byte lines (median of 3)")
    base = devnull_baseline(args.mb)
    print(f"  {'raw: bash writing to /dev/null':<44} {base:6.2f} s  {args.mb / base:7.1f} MB/s   1.00x")
    with LocalEnvironment() as env:
        env.execute("true")
        rows = [
            ("local child, unwatched buffer", {"watch": None}),
            ("local child, watched buffer ('ERROR')", {"watch": "ERROR"}),
            ("local child, watched, matching the last line", {"watch": "DONE-MARKER"}),
            ("local detached, watched ('ERROR')", {"watch": "ERROR", "detached": True}),
        ]
        for label, kw in rows:
            runs = [throughput(env, args.mb, **kw) for _ in range(3)]  # type: ignore[arg-type]
            secs, matches = statistics.median(r[0] for r in runs), runs[0][1]
            extra = f"   {matches} match" if kw.get("watch") == "DONE-MARKER" else ""
            print(f"  {label:<44} {secs:6.2f} s  {args.mb / secs:7.1f} MB/s   {secs / base:4.2f}x{extra}")


if __name__ == "__main__":
    main()
