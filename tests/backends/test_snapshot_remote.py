"""Snapshots and forks on real docker and ssh targets."""

from __future__ import annotations


import pytest

from hermes_env_core import create_environment

SETUP = (
    "mkdir -p proj/sub && cd proj/sub && printf 'hello\\n' > note.txt && export GREETING='hi there' "
    "&& COUNT=7 && greet() { echo \"greet $1 $GREETING\"; } && alias ll='echo aliased-ll' && set -o noclobber"
)
CHECK = 'pwd; echo "$GREETING/$COUNT"; greet you; ll; cat note.txt; [[ -o noclobber ]] && echo noclobber'
EXPECT = ["hi there/7", "greet you hi there", "aliased-ll", "hello", "noclobber"]


@pytest.fixture(autouse=True)
def _store(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


# -- docker ---------------------------------------------------------------------------------------
def _images(client, name: str) -> list[str]:
    return [t for i in client.images.list(filters={"label": f"hermes-env.snapshot={name}"}) for t in i.tags]


def _ssh(server, tmp_path, **options):
    kw = {
        "host": server.host, "port": server.port, "user": server.user,
        "key_path": str(server.client_key_path), "use_agent": False, "look_for_keys": False,
        "known_hosts": str(tmp_path / "known_hosts"), "timeout": 60,
    }
    kw.update(options)
    return create_environment("ssh", **kw)


def test_ssh_snapshot_restores_state_and_files(sshd_server, tmp_path):
    with _ssh(sshd_server, tmp_path) as env:
        base = env.execute('d=$(mktemp -d) && cd "$d" && pwd').output.strip()
        assert env.execute(SETUP).exit_code == 0
        snap = env.snapshot("remote")
        assert snap.files.roots == (f"{base}/proj/sub",)
        assert "password" not in snap.options
        env.execute("echo changed >| note.txt")
    with _ssh(sshd_server, tmp_path, snapshot="remote") as new:
        r = new.execute(CHECK)
        lines = r.output.splitlines()
        assert "hermes-env-restore-" in lines[0] and lines[1:] == EXPECT
        fresh = lines[0]
        assert any(f"restored into {base}/proj/sub -> {fresh}" in n for n in r.notes)
        assert new.execute(f"cat {base}/proj/sub/note.txt").output == "changed\n"
    with _ssh(sshd_server, tmp_path) as check:
        assert check.execute(f"test -e {fresh} || echo removed").output == "removed\n"


def test_ssh_fork_diverges(sshd_server, tmp_path):
    with _ssh(sshd_server, tmp_path) as env:
        env.execute('cd "$(mktemp -d)" && echo base > f && export WHO=orig')
        forks = env.fork(3)
        try:
            for i, e in enumerate(forks):
                e.execute(f"echo fork{i} > f; export WHO={i}")
            assert [e.execute('echo "$WHO"; cat f').output for e in forks] == [f"{i}\nfork{i}\n" for i in range(3)]
            assert env.execute('echo "$WHO"; cat f').output == "orig\nbase\n"
        finally:
            for e in forks:
                e.close()
