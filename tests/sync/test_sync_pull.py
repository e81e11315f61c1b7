"""Pull-back: only remote changes applied, conflicts, upload-only, locking, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hermes_env_core.errors import SyncError
from hermes_env_core.sync import CONFLICT_MARKER, SyncMapping, TransportError
from tests.sync._helpers import bump, snapshot, write


def _pushed(make_engine, host: Path, files: dict[str, str], **kw):
    for name, text in files.items():
        write(host / name, text)
    engine = make_engine(**kw)
    engine.push()
    return engine


def test_pull_applies_only_remote_changes(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"same.txt": "s", "host-edit.txt": "h1", "remote-edit.txt": "r1", "sub/deep.txt": "d"})
    bump(host / "host-edit.txt", "h2 (not pushed yet)")
    write(remote / "remote-edit.txt", "r2")
    write(remote / "new" / "made.txt", "by agent")
    os.symlink("made.txt", remote / "new" / "alias")
    (remote / "emptydir").mkdir()
    before = (host / "same.txt").stat().st_mtime_ns
    result = engine.pull()
    assert result.updated == (str(host / "remote-edit.txt"),)
    assert sorted(result.created) == [str(host / "new" / "alias"), str(host / "new" / "made.txt")]
    assert result.deleted == () and result.conflicts == ()
    assert (host / "remote-edit.txt").read_text() == "r2"
    assert (host / "host-edit.txt").read_text() == "h2 (not pushed yet)"
    assert (host / "new" / "made.txt").read_text() == "by agent"
    assert os.readlink(host / "new" / "alias") == "made.txt"
    assert (host / "emptydir").is_dir()
    assert (host / "same.txt").stat().st_mtime_ns == before
    # What came back counts as pushed: only the host's own edit goes out next.
    assert engine.push(force=True).uploaded == ("/work/proj/host-edit.txt",)
    assert engine.pull().changed is False


def test_pulled_file_keeps_mode_and_bytes(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a": "a"})
    blob = bytes(range(256)) * 300 + b"\r\n\0"
    write(remote / "run.sh", blob)
    (remote / "run.sh").chmod(0o755)
    engine.pull()
    assert (host / "run.sh").read_bytes() == blob
    assert (host / "run.sh").stat().st_mode & 0o777 == 0o755


def test_conflict_keeps_host_version_as_backup(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"notes.txt": "v1"})
    bump(host / "notes.txt", "host v2")
    write(remote / "notes.txt", "remote v2")
    result = engine.pull()
    assert len(result.conflicts) == 1
    conflict = result.conflicts[0]
    assert conflict.path == str(host / "notes.txt")
    assert conflict.backup is not None and Path(conflict.backup).parent == host
    assert Path(conflict.backup).name.startswith("notes.txt" + CONFLICT_MARKER)
    assert (host / "notes.txt").read_text() == "remote v2"
    assert Path(conflict.backup).read_text() == "host v2"
    # The backup stays on the host only.
    engine.push(force=True)
    assert sorted(os.listdir(remote)) == ["notes.txt"]


def test_same_change_on_both_sides_is_no_conflict(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "v1"})
    bump(host / "a.txt", "v2")
    write(remote / "a.txt", "v2")
    result = engine.pull()
    assert result.conflicts == () and not result.changed
    assert engine.push(force=True).uploaded == ()


def test_new_file_on_both_sides_with_different_content(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "a"})
    write(host / "b.txt", "host b")
    write(remote / "b.txt", "remote b")
    result = engine.pull()
    assert [c.path for c in result.conflicts] == [str(host / "b.txt")]
    assert (host / "b.txt").read_text() == "remote b"
    assert Path(result.conflicts[0].backup).read_text() == "host b"


def test_deleted_remotely_and_unchanged_on_host_is_deleted(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "a", "dir/b.txt": "b", "dir/inner/c.txt": "c", "keep.txt": "k"})
    (remote / "a.txt").unlink()
    subprocess.run(["rm", "-rf", str(remote / "dir")], check=True)
    result = engine.pull()
    assert sorted(result.deleted) == sorted(str(host / p) for p in ("a.txt", "dir/b.txt", "dir/inner/c.txt"))
    assert sorted(snapshot(host)) == ["keep.txt"]  # the emptied directories went too
    assert engine.push(force=True).deleted == ()


def test_deleted_remotely_but_changed_on_host_is_kept(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "a"})
    bump(host / "a.txt", "precious host edit")
    (remote / "a.txt").unlink()
    result = engine.pull()
    assert result.deleted == ()
    assert [c.path for c in result.conflicts] == [str(host / "a.txt")]
    assert result.conflicts[0].backup is None
    assert (host / "a.txt").read_text() == "precious host edit"
    # The host version wins and goes back to the target.
    assert engine.push(force=True).uploaded == ("/work/proj/a.txt",)
    assert (remote / "a.txt").read_text() == "precious host edit"


def test_deleted_on_host_but_changed_remotely_is_restored(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "a"})
    (host / "a.txt").unlink()
    write(remote / "a.txt", "agent work")
    result = engine.pull()
    assert result.created == (str(host / "a.txt"),)
    assert [c.path for c in result.conflicts] == [str(host / "a.txt")]
    assert (host / "a.txt").read_text() == "agent work"


def test_upload_only_is_never_pulled(host: Path, remote_base: Path, tmp_path: Path, transport, make_engine) -> None:
    cred = write(tmp_path / "secrets" / "token", "t0")
    creds_dir = tmp_path / "creds"
    write(creds_dir / "key.pem", "k0")
    write(host / "a.txt", "a")
    engine = make_engine(
        SyncMapping(host, "/work/proj"),
        SyncMapping(cred, "/work/proj/.token", upload_only=True),
        SyncMapping(creds_dir, "/root/.creds", upload_only=True),
    )
    engine.push()
    write(remote_base / "work/proj/.token", "tampered")
    write(remote_base / "root/.creds/key.pem", "tampered")
    write(remote_base / "root/.creds/extra", "planted")
    result = engine.pull()
    assert not result.changed and result.conflicts == ()
    assert cred.read_text() == "t0"
    assert snapshot(creds_dir) == {"key.pem": ("file", b"k0")}
    assert not (host / ".token").exists()  # not pulled into the enclosing mapping either
    assert [c for c in transport.calls if c[0] == "download"] == [("download", ("/work/proj", None))]


def test_missing_remote_root_deletes_nothing(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "a"})
    subprocess.run(["rm", "-rf", str(remote)], check=True)
    result = engine.pull()
    assert result.missing == ("/work/proj",)
    assert not result.changed
    assert (host / "a.txt").read_text() == "a"


def test_file_mapping_pulls_its_file(host: Path, remote_base: Path, tmp_path: Path, make_engine) -> None:
    f = write(tmp_path / "notes.md", "n1")
    engine = make_engine(SyncMapping(f, "/work/notes.md"))
    engine.push()
    write(remote_base / "work" / "notes.md", "n2")
    write(remote_base / "work" / "other.md", "not mine")
    result = engine.pull()
    assert result.updated == (str(f),)
    assert f.read_text() == "n2"
    assert not (tmp_path / "other.md").exists()


def test_transient_download_errors_are_retried(host: Path, remote: Path, transport, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "a"})
    write(remote / "a.txt", "b")
    failures = [2]

    def flaky(op: str, args: tuple) -> None:
        if op == "download" and failures[0]:
            failures[0] -= 1
            raise TransportError("channel closed", transient=True)

    transport.hooks.append(flaky)
    assert engine.pull().updated == (str(host / "a.txt"),)
    assert make_engine.delays == [0.2, 0.4]


def test_pull_does_not_trust_paths_of_a_failed_push(host: Path, remote: Path, transport, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "v1"})
    bump(host / "a.txt", "v2 on host")

    def partial(op: str, args: tuple) -> None:
        if op == "upload":
            write(remote / "a.txt", "v2 o")  # cut off mid-file
            raise TransportError("broken pipe", transient=False)

    transport.hooks.append(partial)
    with pytest.raises(SyncError):
        engine.push(force=True)
    transport.hooks.clear()
    result = engine.pull()
    assert result.conflicts == () and not result.changed
    assert result.skipped[0][0] == str(host / "a.txt")
    assert (host / "a.txt").read_text() == "v2 on host"


def test_ctrl_c_during_apply_is_deferred_until_the_tree_is_consistent(host: Path, remote: Path, make_engine) -> None:
    files = {f"f{i:02}.txt": f"v1-{i}" for i in range(20)}
    engine = _pushed(make_engine, host, files)
    for name in files:
        write(remote / name, "v2")
    (remote / "f00.txt").unlink()
    seen: list[str] = []

    def trace(event: str, detail: str) -> None:
        if event == "apply-file":
            seen.append(detail)
            if len(seen) == 3:
                os.kill(os.getpid(), signal.SIGINT)

    engine._trace_hook = trace
    with pytest.raises(KeyboardInterrupt):
        engine.pull()
    assert len(seen) == 20  # every action ran before the interrupt was delivered
    assert sorted(snapshot(host)) == sorted(n for n in files if n != "f00.txt")
    assert all((host / n).read_text() == "v2" for n in files if n != "f00.txt")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    engine._trace_hook = None
    assert not engine.pull().changed  # bookkeeping matches the tree


_CHILD = textwrap.dedent(
    """
    import sys
    from hermes_env_core.sync import LocalDirTransport, SyncEngine, SyncMapping
    host, remote, locks, tag = sys.argv[1:5]
    out = open(sys.stdout.fileno(), "w", buffering=1)

    def trace(event, detail):
        if event in ("lock-wait", "lock-acquired", "apply-done"):
            out.write(f"{tag} {event}\\n")
        if event == "apply-start":
            out.write(f"{tag} apply-start\\n")
            sys.stdin.readline()  # hold the lock until the parent says go

    engine = SyncEngine(LocalDirTransport(remote), [SyncMapping(host, "/proj")], lock_dir=locks, trace=trace)
    engine.pull()
    out.write(f"{tag} exit\\n")
    """
)


def test_concurrent_pulls_into_one_tree_take_turns(host: Path, tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    for tag in ("A", "B"):
        write(tmp_path / f"remote{tag}" / "proj" / f"from-{tag}.txt", tag)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def start(tag: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(host), str(tmp_path / f"remote{tag}"), str(locks), tag],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )

    a = start("A")
    assert a.stdout.readline() == "A lock-acquired\n"
    assert a.stdout.readline() == "A apply-start\n"
    b = start("B")
    try:
        assert b.stdout.readline() == "B lock-wait\n"  # A holds the tree
        a.stdin.write("go\n")
        a.stdin.flush()
        assert a.stdout.readline() == "A apply-done\n"
        assert b.stdout.readline() == "B lock-acquired\n"
        assert b.stdout.readline() == "B apply-start\n"
        b.stdin.write("go\n")
        b.stdin.flush()
        assert b.stdout.readline() == "B apply-done\n"
    finally:
        for p in (a, b):
            p.stdin.close()
            assert p.wait(timeout=30) == 0
    assert sorted(os.listdir(host)) == ["from-A.txt", "from-B.txt"]


def test_pull_progress_counts_actions(host: Path, remote: Path, make_engine) -> None:
    engine = _pushed(make_engine, host, {"a.txt": "a", "b.txt": "b"})
    write(remote / "a.txt", "a2")
    (remote / "b.txt").unlink()
    write(remote / "c.txt", "c")
    seen = []
    engine.pull(progress=seen.append)
    assert [(p.phase, p.files_done, p.files_total) for p in seen] == [("pull", 1, 3), ("pull", 2, 3), ("pull", 3, 3)]
