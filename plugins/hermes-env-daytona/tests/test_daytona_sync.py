"""File sync through the core's SyncEngine over the Daytona transport, against the emulator."""

from __future__ import annotations

import os
import shutil
import stat
import threading

import pytest
from hermes_env_daytona.transport import DaytonaSyncTransport


def _tree(root):
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    (root / "blob.bin").write_bytes(bytes(range(256)) * 100)
    os.symlink("run.sh", root / "link")
    (root / "node_modules").mkdir()
    (root / "node_modules" / "skip.js").write_text("never synced\n")
    return root


def _sync_uploads(emu) -> int:
    """Uploads of sync archives (each command may also upload its private script)."""
    return len([p for p in emu.uploaded_paths if "/.cache/hermes-env/sync-" in p])


@pytest.fixture
def project(tmp_path):
    return _tree(tmp_path / "project")


def test_push_before_the_first_command(emu, make_env, project):
    env = make_env(sync=[{"host": str(project), "remote": "project"}], sync_interval_s=0)
    r = env.execute("cat project/src/pkg/mod.py; project/run.sh; readlink project/link; ls project")
    assert r.output == "print('hi')\nrun\nrun.sh\nblob.bin\nlink\nrun.sh\nsrc\n"
    (record,) = emu.sandboxes.values()
    synced = record.root / "project"
    assert (synced / "blob.bin").read_bytes() == (project / "blob.bin").read_bytes()
    assert stat.S_IMODE((synced / "run.sh").stat().st_mode) == 0o755
    assert not (synced / "node_modules").exists()
    # One upload request for the whole tree.
    assert _sync_uploads(emu) == 1


def test_changes_and_deletions_follow(emu, make_env, project):
    env = make_env(sync=[{"host": str(project), "remote": "project"}], sync_interval_s=0)
    env.execute("true")
    (project / "src" / "pkg" / "mod.py").write_text("print('changed')\n")
    (project / "blob.bin").unlink()
    shutil.rmtree(project / "src" / "pkg")
    (project / "new.txt").write_text("new\n")
    uploads = _sync_uploads(emu)
    r = env.execute("ls -R project | sort; cat project/new.txt")
    assert "blob.bin" not in r.output and "mod.py" not in r.output and "pkg" not in r.output
    assert r.output.endswith("new\n")
    assert _sync_uploads(emu) == uploads + 1
    # Nothing changed: no transfer at all.
    requests = len(emu.requests)
    env.execute("true")
    # Only the command itself: no archive went up, no helper ran (tar, rm).
    assert _sync_uploads(emu) == uploads + 1
    assert not [r for r in emu.requests[requests:] if r.path.endswith("/process/execute")]


def test_absolute_remote_path(make_env, project, task_id):
    target = f"/tmp/hermes-sync-{task_id}"
    env = make_env(sync=[{"host": str(project), "remote": target}])
    try:
        assert env.execute(f"cat {target}/src/pkg/mod.py").output == "print('hi')\n"
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_pull_brings_the_sandbox_changes_back(make_env, project):
    env = make_env(sync=[{"host": str(project), "remote": "project"}])
    env.execute(
        "cd project && echo made > made.txt && mkdir -p out/deep && printf 'x\\0y' > out/deep/bin "
        "&& echo edited > run.sh && rm blob.bin"
    )
    result = env.pull_files()
    assert (project / "made.txt").read_text() == "made\n"
    assert (project / "out" / "deep" / "bin").read_bytes() == b"x\0y"
    assert (project / "run.sh").read_text() == "edited\n"
    assert not (project / "blob.bin").exists()
    assert result.changed


def test_cleanup_pulls_back_and_upload_only_is_never_pulled(make_env, tmp_path, project):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "token").write_text("secret\n")
    env = make_env(
        sync=[
            {"host": str(project), "remote": "project"},
            {"host": str(creds), "remote": "creds", "upload_only": True},
        ]
    )
    env.execute("echo late > project/late.txt; echo tampered > creds/token; echo extra > creds/extra")
    env.close()
    assert (project / "late.txt").read_text() == "late\n"
    assert (creds / "token").read_text() == "secret\n"
    assert not (creds / "extra").exists()


def test_missing_remote_tree_pulls_nothing(make_env, project):
    env = make_env(sync=[{"host": str(project), "remote": "project"}])
    env.execute("rm -rf project")
    result = env.pull_files()
    assert result.missing == ("project",)
    assert (project / "run.sh").exists()  # a missing remote tree never deletes the host's


def test_transport_download_of_a_missing_path_is_none(make_env):
    env = make_env()
    env.execute("true")
    transport = DaytonaSyncTransport(env)
    assert transport.download(".", "no-such-dir") is None
    assert transport.download("no/such/root") is None


def test_commands_do_not_queue_behind_an_upload(make_env, project):
    env = make_env(sync=[{"host": str(project), "remote": "project"}], sync_interval_s=0)
    env.execute("true")
    transport = env.sync_engine.transport
    entered, release = threading.Event(), threading.Event()
    real_upload = transport.upload

    def slow_upload(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real_upload(*args, **kwargs)

    transport.upload = slow_upload
    (project / "new.txt").write_text("new\n")
    pushing = threading.Thread(target=env.execute, args=("true",))
    pushing.start()
    try:
        assert entered.wait(10)
        # Another command runs now, while the first one's upload is in flight.
        assert env.execute("echo meanwhile").output == "meanwhile\n"
    finally:
        release.set()
        pushing.join(30)
    assert env.execute("cat project/new.txt").output == "new\n"


def test_a_recreated_sandbox_gets_every_file_again(emu, make_env, project, task_id):
    from daytona import Daytona, DaytonaConfig

    from hermes_env_core.testing import wait_until

    # Absolute paths: the emulator gives every sandbox its own home path, a real service the same one.
    target = f"/tmp/hermes-sync-{task_id}"
    env = make_env(sync=[{"host": str(project), "remote": target}], sync_interval_s=0)
    try:
        env.execute("cd /tmp")
        old = env.sandbox.id
        assert emu.events.wait_connected(1, timeout=10)
        client = Daytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key))
        client.delete(client.get(old))
        shutil.rmtree(target)  # what deleting a real sandbox does to its files
        assert wait_until(lambda: str(env._sandbox.state.value) == "destroyed", 10)
        r = env.execute(f"cat {target}/src/pkg/mod.py")
        assert r.output == "print('hi')\n" and env.sandbox.id != old
    finally:
        shutil.rmtree(target, ignore_errors=True)
