"""The sync engine against a real OpenSSH server, through raw paramiko exec
channels (``ParamikoRunner`` + ``CommandTransport``), not the ssh backend."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import pytest

from hermes_env_core.sync import (
    CommandFailedError,
    CommandTransport,
    SyncEngine,
    SyncMapping,
)
from hermes_env_core.sync.paramiko_runner import ParamikoRunner
from tests.sync._helpers import bump, snapshot, write

pytestmark = pytest.mark.ssh

BLOB = bytes(range(256)) * 100 + b"\r\n\0"


def connect(server):
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return server.paramiko_client(sock=sock)


class CountingRunner:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.scripts: list[str] = []

    def __call__(self, script, stdin):
        self.scripts.append(script)
        return self.inner(script, stdin)


def sh(runner, script: str) -> bytes:
    out = runner(script, None)
    data = out.read()
    out.close()
    return data


@pytest.fixture
def client(sshd_server):
    c = connect(sshd_server)
    yield c
    c.close()


@pytest.fixture
def runner(client) -> CountingRunner:
    return CountingRunner(ParamikoRunner(client.get_transport(), timeout=30))


@pytest.fixture
def remote_dir(sshd_server, runner):
    path = f"{sshd_server.home}/sync-test-{secrets.token_hex(4)}"
    yield path
    sh(runner, f"rm -rf {path}")


def _engine(runner, host: Path, remote_dir: str, tmp_path: Path, **kw) -> SyncEngine:
    return SyncEngine(
        CommandTransport(runner, stream_stdin=True),
        [SyncMapping(host, remote_dir)],
        lock_dir=str(tmp_path / "locks"),
        **kw,
    )


def test_push_and_pull_a_tree_over_ssh(sshd_server, runner, remote_dir: str, tmp_path: Path) -> None:
    host = tmp_path / "host"
    for i in range(50):
        write(host / f"pkg{i % 5}" / f"mod{i}.py", f"print({i})\n")
    write(host / "data.bin", BLOB)
    write(host / "odd name\nwith newline", "odd")
    write(host / "run.sh", "#!/bin/sh\necho hi\n").chmod(0o755)
    os.symlink("data.bin", host / "alias")
    write(host / ".git" / "HEAD", "ref: refs/heads/main\n")
    engine = _engine(runner, host, remote_dir, tmp_path)

    before = len(runner.scripts)
    result = engine.push()
    assert len(result.uploaded) == 54
    assert len(runner.scripts) - before == 1  # one exec channel for the whole tree
    assert "tar -x" in runner.scripts[-1]
    # The remote is on this machine: check what sshd's user actually got.
    remote = Path(remote_dir)
    assert snapshot(remote) == {k: v for k, v in snapshot(host).items() if not k.startswith(".git")}
    assert (remote / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (remote / "data.bin").stat().st_uid == sshd_server.uid
    assert sh(runner, f"cd {remote_dir} && sha256sum data.bin").split()[0].decode() == __import__("hashlib").sha256(BLOB).hexdigest()

    # The agent works in the target.
    sh(runner, f"cd {remote_dir} && echo changed > pkg0/mod0.py && rm pkg1/mod1.py && rm -r pkg2 "
               f"&& mkdir -p out && head -c 3000 data.bin > out/part.bin && ln -s ../run.sh out/run")
    bump(host / "pkg3" / "mod3.py", "host edit\n")
    sh(runner, f"cd {remote_dir} && echo agent > pkg3/mod3.py")
    pulled = engine.pull()
    assert sorted(Path(p).relative_to(host).as_posix() for p in pulled.created) == ["out/part.bin", "out/run"]
    assert sorted(Path(p).relative_to(host).as_posix() for p in pulled.updated) == ["pkg0/mod0.py", "pkg3/mod3.py"]
    assert len(pulled.deleted) == 11  # pkg1/mod1.py and the ten files of pkg2
    assert not (host / "pkg2").exists()
    assert (host / "pkg0" / "mod0.py").read_text() == "changed\n"
    assert (host / "out" / "part.bin").read_bytes() == BLOB[:3000]
    assert os.readlink(host / "out" / "run") == "../run.sh"
    [conflict] = pulled.conflicts
    assert conflict.path == str(host / "pkg3" / "mod3.py")
    assert Path(conflict.backup).read_text() == "host edit\n"
    assert (host / "pkg3" / "mod3.py").read_text() == "agent\n"
    # Both sides agree now: nothing to push, nothing to pull.
    assert not engine.push(force=True).changed
    assert not engine.pull().changed


def test_deletes_over_ssh(runner, remote_dir: str, tmp_path: Path) -> None:
    host = tmp_path / "host"
    write(host / "keep.txt")
    write(host / "-dash")
    write(host / "dir" / "x")
    engine = _engine(runner, host, remote_dir, tmp_path)
    engine.push()
    (host / "-dash").unlink()
    (host / "dir" / "x").unlink()
    (host / "dir").rmdir()
    engine.push(force=True)
    assert sorted(os.listdir(remote_dir)) == ["keep.txt"]


def test_symlink_escape_made_in_the_target_is_skipped_and_the_rest_applied(
    runner, remote_dir: str, tmp_path: Path
) -> None:
    host = tmp_path / "host"
    write(host / "a.txt", "a")
    engine = _engine(runner, host, remote_dir, tmp_path)
    engine.push()
    sh(runner, f"cd {remote_dir} && echo new > a.txt && ln -s /etc evil")
    result = engine.pull()
    ((path, why),) = result.skipped
    assert path == str(host / "evil") and "'evil' -> '/etc'" in why
    assert not os.path.lexists(host / "evil")
    assert (host / "a.txt").read_text() == "new\n"


def test_pull_survives_a_killed_session(private_sshd_server, tmp_path: Path) -> None:
    server = private_sshd_server
    clients = [connect(server)]
    handed_out_after_kill = [0]
    killed = [False]

    def current():
        # Like a backend: it hands out its Transport, and reconnects once a
        # command on it has failed.
        if killed[0]:
            handed_out_after_kill[0] += 1
            if handed_out_after_kill[0] == 2:
                clients.append(connect(server))
        return clients[-1].get_transport()

    runner = ParamikoRunner(current, timeout=30)
    remote_dir = f"{server.home}/sync-test-{secrets.token_hex(4)}"
    host = tmp_path / "host"
    write(host / "a.txt", "a")
    delays: list[float] = []
    engine = SyncEngine(CommandTransport(runner, stream_stdin=True), [SyncMapping(host, remote_dir)],
                        lock_dir=str(tmp_path / "locks"), sleep=delays.append)
    try:
        engine.push()
        sh(runner, f"echo remote > {remote_dir}/a.txt")
        assert server.kill_user_sessions()  # the connection drops without a goodbye
        killed[0] = True
        result = engine.pull()
        assert result.updated == (str(host / "a.txt"),)
        assert (host / "a.txt").read_text() == "remote\n"
        assert delays == [0.2] and len(clients) == 2
    finally:
        sh(runner, f"rm -rf {remote_dir}")
        for c in clients:
            c.close()


def test_a_failing_remote_command_is_reported_not_retried(runner, remote_dir: str, tmp_path: Path) -> None:
    host = tmp_path / "host"
    for i in range(200):
        write(host / f"f{i}.txt", "x" * 2000)
    sh(runner, f"mkdir -p {os.path.dirname(remote_dir)} && echo file > {remote_dir}")  # a file where the tree goes
    delays: list[float] = []
    engine = SyncEngine(CommandTransport(runner, stream_stdin=True), [SyncMapping(host, remote_dir + "/proj")],
                        lock_dir=str(tmp_path / "locks"), sleep=delays.append)
    with pytest.raises(CommandFailedError, match="Not a directory|File exists") as info:
        engine.push()
    assert info.value.exit_code != 0 and delays == []
    sh(runner, f"rm -f {remote_dir}")
    assert len(engine.push().uploaded) == 200  # everything is retried
