"""File sync in direct mode: the core SyncEngine over ModalSyncTransport, against
the emulator (whose sandbox home is a real directory we can look into)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest
from hermes_env_modal import ModalEnvironment


def _env(tmp_path: Path, **kw):
    return ModalEnvironment(
        mode="direct",
        task_id=f"sync-{uuid.uuid4().hex[:8]}",
        sync=[{"host": str(tmp_path / "proj"), "remote": "proj"}],
        sync_interval_s=0,
        **kw,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    (proj / "src" / "deep").mkdir(parents=True)
    (proj / "a.txt").write_text("alpha\n")
    (proj / "src" / "deep" / "b.bin").write_bytes(bytes(range(256)) * 10)
    (proj / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (proj / "run.sh").chmod(0o755)
    (proj / ".git").mkdir()
    (proj / ".git" / "HEAD").write_text("ref\n")  # excluded by default
    return proj


def _execs(emu, sandbox_id: str, needle: str) -> list:
    return [p for p in emu.sandboxes[sandbox_id].execs.values() if needle in " ".join(p.argv)]


def test_push_before_the_first_command_in_one_compressed_stream(fresh_modal_emu, tmp_path, tree):
    with _env(tmp_path, pull_on_close=False) as env:
        r = env.execute("cat ~/proj/a.txt; ~/proj/run.sh; sha256sum < ~/proj/src/deep/b.bin; ls -a ~/proj")
        digest = hashlib.sha256(bytes(range(256)) * 10).hexdigest()
        assert r.output.splitlines()[:3] == ["alpha", "ran", f"{digest}  -"]
        assert ".git" not in r.output.split()
        uploads = _execs(fresh_modal_emu, env.sandbox_id, "tar -x -z")
        assert len(uploads) == 1  # one exec carries every file


def test_changes_and_deletions_follow(modal_emu, tmp_path, tree):
    with _env(tmp_path, pull_on_close=False) as env:
        assert env.execute("cat ~/proj/a.txt").output == "alpha\n"
        (tree / "a.txt").write_text("beta, longer\n")
        (tree / "src" / "deep" / "b.bin").unlink()
        (tree / "new.txt").write_text("new\n")
        r = env.execute("cat ~/proj/a.txt ~/proj/new.txt; test -e ~/proj/src/deep/b.bin || echo gone")
        assert r.output == "beta, longer\nnew\ngone\n"


def test_large_upload_is_chunked_under_the_sdk_limit(fresh_modal_emu, tmp_path, tree):
    blob = os.urandom(3 * 1024 * 1024 + 17)  # incompressible: > 3 chunks of 1 MiB
    (tree / "blob").write_bytes(blob)
    with _env(tmp_path, pull_on_close=False) as env:
        before = fresh_modal_emu.call_count("TaskExecStdinWrite")
        r = env.execute("sha256sum < ~/proj/blob")
        assert r.output.split()[0] == hashlib.sha256(blob).hexdigest()
        writes = fresh_modal_emu.call_count("TaskExecStdinWrite") - before
        assert writes >= 4  # 3+ data chunks and the EOF
        (upload,) = _execs(fresh_modal_emu, env.sandbox_id, "tar -x -z")
        assert upload.stdin_offset < len(blob) + 64 * 1024  # compressed stream, sent once


def test_pull_brings_sandbox_changes_back_byte_exact(modal_emu, tmp_path, tree):
    with _env(tmp_path) as env:
        env.execute("echo changed > ~/proj/a.txt; head -c 200000 /dev/urandom > ~/proj/made.bin; rm ~/proj/run.sh")
        home = Path(env.execute('printf %s "$HOME"').output)
        made = (home / "proj" / "made.bin").read_bytes()
        result = env.pull_files()
        assert result is not None and result.changed
        assert (tree / "a.txt").read_text() == "changed\n"
        assert (tree / "made.bin").read_bytes() == made  # binary-safe download
        assert not (tree / "run.sh").exists()
        env.execute("echo at-close > ~/proj/late.txt")
    assert (tree / "late.txt").read_text() == "at-close\n"  # pull_on_close


def test_credential_files_are_pushed_but_never_pulled(modal_emu, tmp_path, tree, monkeypatch):
    home = tmp_path / "home"
    (home / ".config" / "tool").mkdir(parents=True)
    cred = home / ".config" / "tool" / "token"
    cred.write_text("s3cret\n")
    monkeypatch.setenv("HOME", str(home))
    with ModalEnvironment(
        mode="direct", task_id=f"cred-{uuid.uuid4().hex[:8]}", credential_files=[str(cred)], sync_interval_s=0
    ) as env:
        assert env.execute("cat ~/.config/tool/token").output == "s3cret\n"
        env.execute("echo tampered > ~/.config/tool/token")
        env.pull_files()
    assert cred.read_text() == "s3cret\n"
