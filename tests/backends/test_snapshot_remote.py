"""Snapshots and forks on real docker and ssh targets."""

from __future__ import annotations


import pytest

from hermes_env_core import CorruptSnapshotError, create_environment
from hermes_env_core.cli import main as cli_main

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
    # Tags of this snapshot name only: an image left by an earlier, killed run may carry the label too.
    images = client.images.list(filters={"label": f"hermes-env.snapshot={name}"})
    return [t for i in images for t in i.tags if t.startswith(f"hermes-env-snapshot:{name}-")]


def test_docker_snapshot_restores_state_and_files(docker_client, docker_image):
    with create_environment("docker", image=docker_image) as env:
        assert env.execute(SETUP + " && mkdir -p /srv/x && echo in-rootfs > /srv/x/rootfile").exit_code == 0
        snap = env.snapshot("dock")
        assert snap.files.kind == "image" and snap.files.digest.startswith("sha256:")
        env.execute("echo changed >| note.txt")
        first = env.container_id
    assert snap.files.ref in _images(docker_client, "dock")
    with create_environment("docker", snapshot="dock") as new:
        assert new.container_id != first
        r = new.execute(CHECK + "; cat /srv/x/rootfile")
        assert r.output.splitlines() == ["/workspace/proj/sub", *EXPECT, "in-rootfs"]
        again = new.snapshot("dock-again")  # of a container whose image is a snapshot
    labels = docker_client.images.get(again.files.ref).labels
    assert labels["hermes-env.snapshot"] == "dock-again"
    assert cli_main(["snapshots", "rm", "dock-again"]) == 0
    assert cli_main(["snapshots", "rm", "dock"]) == 0
    assert snap.files.ref not in _images(docker_client, "dock")


def test_docker_snapshot_with_its_image_gone_is_refused(docker_client, docker_image):
    with create_environment("docker", image=docker_image) as env:
        snap = env.snapshot("gone")
    docker_client.images.remove(snap.files.ref)
    with pytest.raises(CorruptSnapshotError, match="image .* is gone"):
        create_environment("docker", snapshot="gone")
    # Another image under the snapshot's tag is not the one committed.
    repo, tag = snap.files.ref.split(":")
    docker_client.images.get(docker_image).tag(repo, tag)
    try:
        with pytest.raises(CorruptSnapshotError, match="that was committed; refused"):
            create_environment("docker", snapshot="gone")
    finally:
        docker_client.images.remove(snap.files.ref)
    assert cli_main(["snapshots", "rm", "gone"]) == 0


def test_docker_fork_diverges(docker_client, docker_image):
    with create_environment("docker", image=docker_image) as env:
        env.execute("cd /workspace && echo base > f && N=0 && inc() { N=$((N+1)); }")
        forks = env.fork(3)
        try:
            ids = {e.container_id for e in forks}
            assert len(ids) == 3 and env.container_id not in ids
            [tag] = {t for e in forks for t in [e.config.image]}
            assert docker_client.images.list(filters={"reference": tag})
            for i, e in enumerate(forks):
                for _ in range(i + 1):
                    e.execute("inc")
                e.execute(f"echo fork{i} > f; export WHO={i}")
            for i, e in enumerate(forks):
                assert e.execute('echo "$N $WHO"; cat f').output == f"{i + 1} {i}\nfork{i}\n"
            assert env.execute('echo "$N [${WHO-}]"; cat f').output == "0 []\nbase\n"
        finally:
            for e in forks:
                e.close()
    # The fork's image went with the last fork.
    assert tag.startswith("hermes-env-snapshot:fork-")
    assert not docker_client.images.list(filters={"reference": tag})


# -- ssh ------------------------------------------------------------------------------------------
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
