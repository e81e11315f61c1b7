"""Sync engine benchmark against a real OpenSSH server on 127.0.0.1.

In one run, on one paramiko Transport (TCP_NODELAY):
  * first push of 2,000 small files through the engine (one tar stream over one
    exec channel) vs one SFTP ``put`` per file (target: engine >= 10x faster);
  * a no-change sync check over the same 2,000 files (target: median <= 20 ms).

    python bench/bench_sync.py [--files 2000] [--rounds 5] [--check]

Needs root (it starts sshd for a test user, see tests/support/sshd.py).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hermes_env_core.sync import CommandTransport, SyncEngine, SyncMapping
from hermes_env_core.sync.paramiko_runner import ParamikoRunner
from tests.support.sshd import SshServer


def make_tree(root: Path, files: int) -> list[str]:
    """``files`` small files (100-400 bytes) in 40 directories, two levels deep."""
    rels = []
    for i in range(files):
        rel = f"pkg{i % 8}/mod{i % 40 // 8}/file{i:05}.py"
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(50 + i % 150).hex().encode())
        rels.append(rel)
    return rels


def sh(runner: ParamikoRunner, script: str) -> None:
    out = runner(script, None)
    while out.read(65536):
        pass
    out.close()


def sftp_push(sftp, host: Path, rels: list[str], remote: str) -> None:
    made = set()
    for rel in rels:
        parent = os.path.dirname(rel)
        parts = parent.split("/")
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in made:
                sftp.mkdir(f"{remote}/{d}")
                made.add(d)
        sftp.put(str(host / rel), f"{remote}/{rel}")


def measure(server, work: Path, files: int, rounds: int, remote_base: str) -> dict[str, object]:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client = server.paramiko_client(sock=sock)
    runner = ParamikoRunner(client.get_transport(), timeout=120)
    host = work / "host"
    rels = make_tree(host, files) if not host.exists() else sorted(
        p.relative_to(host).as_posix() for p in host.rglob("*") if p.is_file()
    )
    base = f"{remote_base}/hermes-bench-{secrets.token_hex(4)}"
    sh(runner, f"mkdir -p {base}")
    out: dict[str, object] = {"files": len(rels), "bytes": sum((host / r).stat().st_size for r in rels)}
    try:
        # Engine and SFTP rounds alternate, into fresh directories, and nothing
        # is deleted until the end: the disk's journal stalls then hit both alike.
        sftp = client.open_sftp()
        engine_times: list[float] = []
        sftp_times: list[float] = []
        for i in range(rounds):
            for j in range(2):
                remote = f"{base}/engine{i}-{j}"
                engine = SyncEngine(CommandTransport(runner, stream_stdin=True), [SyncMapping(host, remote)],
                                    lock_dir=str(work / "locks"))
                t0 = time.perf_counter()
                result = engine.push()
                engine_times.append(time.perf_counter() - t0)
                assert len(result.uploaded) == len(rels), result
            remote = f"{base}/sftp{i}"
            sftp.mkdir(remote)
            t0 = time.perf_counter()
            sftp_push(sftp, host, rels, remote)
            sftp_times.append(time.perf_counter() - t0)
        sftp.close()

        remote = f"{base}/steady"
        engine = SyncEngine(CommandTransport(runner, stream_stdin=True), [SyncMapping(host, remote)],
                            lock_dir=str(work / "locks"))
        engine.push()
        check_times = []
        for _ in range(rounds * 20):
            t0 = time.perf_counter()
            result = engine.push(force=True)
            check_times.append(time.perf_counter() - t0)
            assert not result.changed
        (host / rels[0]).write_bytes(secrets.token_bytes(64))
        t0 = time.perf_counter()
        changed = engine.push(force=True)
        out["one_change"] = time.perf_counter() - t0
        assert changed.uploaded == (f"{remote}/{rels[0]}",)
        out.update(engine=engine_times, sftp=sftp_times, check=check_times)
    finally:
        t0 = time.perf_counter()
        sh(runner, f"rm -rf {base}")
        out["cleanup"] = time.perf_counter() - t0
        client.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5, help="SFTP rounds; engine pushes run twice as often")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hermes-bench-sync-"))
    results = []
    try:
        with SshServer() as server:
            print(f"sshd on {server.host}:{server.port}; {args.files} files", flush=True)
            # The remote tree on the test user's disk (home), and on tmpfs,
            # where creating 2,000 files costs little and the transfer method
            # is what is measured.
            for label, base in (("home (ext4)", str(server.home)), ("tmpfs (/dev/shm)", "/dev/shm")):
                results.append((label, measure(server, work, args.files, args.rounds, base)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ms(v: float) -> str:
        return f"{v * 1000:.1f} ms"

    ok = True
    for label, r in results:
        engine_t, sftp_t, check_t = r["engine"], r["sftp"], r["check"]
        eng, ftp, chk = (statistics.median(x) for x in (engine_t, sftp_t, check_t))  # type: ignore[arg-type]
        ratio = ftp / eng
        ok_ratio, ok_check = ratio >= 10.0, chk <= 0.020
        ok = ok and ok_ratio and ok_check
        print(f"\n== remote tree on {label}: {r['files']} files, {r['bytes']} bytes")
        print(f"first push, engine (one tar stream, one channel): median {ms(eng):>10}  "
              f"(n={len(engine_t)}, min {ms(min(engine_t))}, max {ms(max(engine_t))})")
        print(f"first push, one SFTP put per file, same Transport: median {ms(ftp):>10}  "
              f"(n={len(sftp_t)}, min {ms(min(sftp_t))}, max {ms(max(sftp_t))})")
        print(f"ratio SFTP/engine: {ratio:.1f}x  (target >= 10x)  {'OK' if ok_ratio else 'MISSED'}")
        p90 = sorted(check_t)[int(len(check_t) * 0.9)]
        print(f"no-change sync check over {r['files']} files: median {chk * 1000:.2f} ms, p90 {p90 * 1000:.2f} ms  "
              f"(n={len(check_t)}; target <= 20 ms)  {'OK' if ok_check else 'MISSED'}")
        print(f"one changed file (check + upload): {ms(r['one_change'])}")  # type: ignore[arg-type]
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
