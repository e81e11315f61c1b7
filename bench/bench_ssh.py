"""SSH backend overhead: ``execute('true')`` against raw paramiko ``exec_command('true')``.

Both run in one process against the same real sshd on 127.0.0.1 (tests/support/sshd.py,
needs root), the raw baseline on one Transport with TCP_NODELAY. Target: median <= 1.5x raw.

    python bench/bench_ssh.py [-n 100]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paramiko

from hermes_env_core.backends.ssh import SSHEnvironment
from tests.support.sshd import SshServer

from _timing import timed  # bench/ is the script's own directory


def raw_transport(server: SshServer) -> paramiko.Transport:
    sock = socket.create_connection((server.host, server.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = paramiko.Transport(sock)
    t.start_client(timeout=10)
    t.auth_publickey(server.user, paramiko.PKey.from_path(str(server.client_key_path)))
    return t


def raw_true(t: paramiko.Transport) -> None:
    chan = t.open_session()
    chan.exec_command("true")
    chan.recv_exit_status()
    chan.close()


def raw_script(t: paramiko.Transport, script: str) -> None:
    chan = t.open_session()
    chan.set_combine_stderr(True)
    chan.exec_command(script)
    while chan.recv(65536):
        pass
    chan.recv_exit_status()
    chan.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=100, help="calls per series")
    args = ap.parse_args()
    with SshServer() as server, tempfile.TemporaryDirectory() as tmp:
        t = raw_transport(server)
        env = SSHEnvironment(
            host=server.host, port=server.port, user=server.user, key_path=str(server.client_key_path),
            use_agent=False, known_hosts=str(Path(tmp) / "known_hosts"),
        )
        try:
            for _ in range(10):  # warm both: sshd, page cache, the session snapshot
                raw_true(t)
                env.execute("true")
            # Interleave the series so that drift on the machine hits both alike.
            # The base class's wrapper for 'true', run raw: splits the overhead
            # into what bash does for the session and what the backend adds.
            wrapped = env.session.wrap("true")
            env.session.release(wrapped)
            raw: list[float] = []
            ours: list[float] = []
            script: list[float] = []
            for _ in range(args.n // 10):
                raw += timed(lambda: raw_true(t), 10)
                ours += timed(lambda: env.execute("true"), 10)
                script += timed(lambda: raw_script(t, wrapped.script), 10)
        finally:
            env.close()
            t.close()
    r, o, w = statistics.median(raw), statistics.median(ours), statistics.median(script)
    ratio = o / r
    print(f"raw paramiko exec_command('true'): median {r * 1000:.2f} ms  (p90 {sorted(raw)[int(len(raw) * 0.9)] * 1000:.2f})")
    print(f"SSHEnvironment.execute('true'):    median {o * 1000:.2f} ms  (p90 {sorted(ours)[int(len(ours) * 0.9)] * 1000:.2f})")
    print(f"raw exec of the wrapped script:    median {w * 1000:.2f} ms  (session wrapper, no backend)")
    print(f"  wrapper in bash: {(w - r) * 1000:+.2f} ms; ssh backend + base class Python: {(o - w) * 1000:+.2f} ms")
    print(f"ratio {ratio:.2f}x (target <= 1.5x): {'ok' if ratio <= 1.5 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
