"""Push: change detection, one stream, deletes, rollback, rate limit, progress."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hermes_env_core.errors import SyncError
from hermes_env_core.sync import FORCE_ENV, SyncMapping, SyncProgress, TransportError
from tests.sync._helpers import bump, snapshot, write


def test_first_push_mirrors_tree_in_one_upload(host: Path, remote: Path, transport, make_engine) -> None:
    for i in range(30):
        write(host / f"d{i % 3}" / f"sub{i % 2}" / f"f{i}.txt", f"content {i}")
    write(host / "top.bin", bytes(range(256)))
    os.symlink("top.bin", host / "alias")
    write(host / ".git" / "HEAD", "ref")
    write(host / "pkg" / "node_modules" / "x.js", "x")
    write(host / "pkg" / "__pycache__" / "m.pyc", "x")
    write(host / ".venv" / "bin" / "python", "x")
    engine = make_engine()
    result = engine.push()
    assert transport.count("upload") == 1
    assert transport.count("delete") == 0
    assert len(result.uploaded) == 32
    got = snapshot(remote)
    want = {
        k: v for k, v in snapshot(host).items()
        if not k.startswith((".git", ".venv", "pkg"))  # pkg holds only excluded dirs: empty dirs are not pushed
    }
    assert got == want
    assert os.readlink(remote / "alias") == "top.bin"


def test_only_changed_files_are_sent(host: Path, remote: Path, transport, make_engine, clock) -> None:
    a = write(host / "a.txt", "a")
    write(host / "b.txt", "b")
    engine = make_engine()
    engine.push()
    bump(a, "a2")
    write(host / "new" / "c.txt", "c")
    clock.now += 10
    result = engine.push()
    assert sorted(result.uploaded) == ["/work/proj/a.txt", "/work/proj/new/c.txt"]
    assert transport.count("upload") == 2
    assert (remote / "a.txt").read_text() == "a2"
    assert (remote / "new" / "c.txt").read_text() == "c"


def test_no_change_means_no_transport_call(host: Path, transport, make_engine) -> None:
    write(host / "a.txt")
    engine = make_engine()
    engine.push()
    calls = len(transport.calls)
    result = engine.push(force=True)
    assert not result.changed and result.checked == 1
    assert len(transport.calls) == calls


def test_touch_without_content_change_is_not_uploaded(host: Path, transport, make_engine) -> None:
    a = write(host / "a.txt", "same")
    engine = make_engine()
    engine.push()
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert engine.push(force=True).uploaded == ()
    assert transport.count("upload") == 1
    # ... but a mode change is.
    a.chmod(0o755)
    assert engine.push(force=True).uploaded == ("/work/proj/a.txt",)


def test_size_change_with_same_mtime_is_detected(host: Path, remote: Path, make_engine) -> None:
    a = write(host / "a.txt", "short")
    engine = make_engine()
    engine.push()
    st = a.stat()
    a.write_text("much longer")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert engine.push(force=True).uploaded == ("/work/proj/a.txt",)
    assert (remote / "a.txt").read_text() == "much longer"


def test_removed_files_and_dirs_are_deleted_remotely(host: Path, remote: Path, transport, make_engine) -> None:
    write(host / "keep.txt")
    write(host / "gone.txt")
    write(host / "dir" / "deep" / "x.txt")
    write(host / "odd name -x\n.txt", "weird")
    engine = make_engine()
    engine.push()
    assert (remote / "odd name -x\n.txt").exists()
    (host / "gone.txt").unlink()
    (host / "odd name -x\n.txt").unlink()
    (host / "dir" / "deep" / "x.txt").unlink()
    (host / "dir" / "deep").rmdir()
    (host / "dir").rmdir()
    result = engine.push(force=True)
    assert sorted(result.deleted) == ["/work/proj/dir/deep/x.txt", "/work/proj/gone.txt", "/work/proj/odd name -x\n.txt"]
    assert transport.count("delete") == 1
    assert snapshot(remote) == {"keep.txt": ("file", b"x")}


def test_remote_dir_with_extra_files_is_kept(host: Path, remote: Path, make_engine) -> None:
    write(host / "dir" / "x.txt")
    engine = make_engine()
    engine.push()
    write(remote / "dir" / "made-by-agent.txt")
    (host / "dir" / "x.txt").unlink()
    (host / "dir").rmdir()
    engine.push(force=True)
    assert sorted(os.listdir(remote / "dir")) == ["made-by-agent.txt"]


def test_file_becomes_directory(host: Path, remote: Path, make_engine) -> None:
    write(host / "thing", "file")
    engine = make_engine()
    engine.push()
    (host / "thing").unlink()
    write(host / "thing" / "inside.txt", "now a dir")
    engine.push(force=True)
    assert (remote / "thing" / "inside.txt").read_text() == "now a dir"


def test_failure_rolls_back_and_next_push_retries_everything(host: Path, remote: Path, transport, make_engine, clock) -> None:
    for i in range(5):
        write(host / f"f{i}.txt", f"v1-{i}")
    engine = make_engine()
    engine.push()
    for i in range(3):
        bump(host / f"f{i}.txt", f"v2-{i}")
    (host / "f4.txt").unlink()

    def fail_upload(op: str, args: tuple) -> None:
        if op == "upload":
            raise TransportError("disk full in the target", transient=False)

    transport.hooks.append(fail_upload)
    clock.now += 10
    with pytest.raises(SyncError, match="disk full"):
        engine.push()
    transport.hooks.clear()
    # The delete went through before the upload failed; the upload did not.
    assert not (remote / "f4.txt").exists()
    assert (remote / "f0.txt").read_text() == "v1-0"
    # The next push is not rate-limited and retries every change of the failed one.
    result = engine.push()
    assert sorted(result.uploaded) == [f"/work/proj/f{i}.txt" for i in range(3)]
    assert result.deleted == ("/work/proj/f4.txt",)
    assert {p: (remote / p).read_text() for p in os.listdir(remote)} == {
        "f0.txt": "v2-0", "f1.txt": "v2-1", "f2.txt": "v2-2", "f3.txt": "v1-3"
    }


def test_failed_push_of_a_file_deleted_before_the_retry_is_deleted_remotely(host: Path, remote: Path, transport, make_engine) -> None:
    write(host / "a.txt")
    engine = make_engine()
    engine.push()
    write(host / "b.txt", "half")

    def partial_then_fail(op: str, args: tuple) -> None:
        if op == "upload":
            write(remote / "b.txt", "ha")  # the target got part of it
            raise TransportError("connection reset", transient=False)

    transport.hooks.append(partial_then_fail)
    with pytest.raises(SyncError):
        engine.push(force=True)
    transport.hooks.clear()
    (host / "b.txt").unlink()
    engine.push()
    assert not (remote / "b.txt").exists()


def test_transient_errors_are_retried_with_backoff(host: Path, remote: Path, transport, make_engine) -> None:
    write(host / "a.txt", "a")
    failures = [2]

    def flaky(op: str, args: tuple) -> None:
        if op == "upload" and failures[0]:
            failures[0] -= 1
            raise TransportError("connection dropped", transient=True)

    transport.hooks.append(flaky)
    engine = make_engine()
    engine.push()
    assert (remote / "a.txt").read_text() == "a"
    assert transport.count("upload") == 3
    assert make_engine.delays == [0.2, 0.4]


def test_transient_errors_give_up_after_the_attempts(host: Path, transport, make_engine) -> None:
    write(host / "a.txt", "a")
    transport.hooks.append(lambda op, args: (_ for _ in ()).throw(ConnectionResetError("gone")))
    engine = make_engine()
    with pytest.raises(TransportError, match="after 4 attempts") as info:
        engine.push()
    assert info.value.transient
    assert transport.count("upload") == 4


def test_rate_limit_and_force(host: Path, transport, make_engine, clock, monkeypatch) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)
    write(host / "a.txt")
    engine = make_engine()
    assert engine.interval == 5.0  # the default
    assert not engine.push().skipped
    write(host / "b.txt")
    clock.now += 4.9
    assert engine.push().skipped
    assert engine.push(force=True).uploaded == ("/work/proj/b.txt",)
    write(host / "c.txt")
    clock.now += 1.0
    assert engine.push().skipped  # 1 s after the forced check
    monkeypatch.setenv(FORCE_ENV, "1")
    assert engine.push().uploaded == ("/work/proj/c.txt",)
    monkeypatch.setenv(FORCE_ENV, "0")
    write(host / "d.txt")
    assert engine.push().skipped
    clock.now += 5.0
    assert engine.push().uploaded == ("/work/proj/d.txt",)


def test_progress_reports_bytes_and_files(host: Path, make_engine) -> None:
    for i in range(40):
        write(host / f"f{i:02}.bin", os.urandom(20_000))
    seen: list[SyncProgress] = []
    engine = make_engine(progress=seen.append)
    result = engine.push()
    assert seen[0].files_done == 0 and seen[0].bytes_done == 0
    last = seen[-1]
    assert last.files_done == last.files_total == 40
    assert last.bytes_done == last.bytes_total == 40 * 20_000  # file content, not tar overhead
    assert result.bytes_sent > last.bytes_total
    assert len(seen) > 3  # the transport reads the stream in chunks
    pairs = [(p.files_done, p.bytes_done) for p in seen]
    assert pairs == sorted(pairs)
    assert all(p.phase == "push" and p.files_total == 40 for p in seen)


def test_unreadable_file_is_reported_and_retried(host: Path, remote: Path, make_engine, monkeypatch) -> None:
    from hermes_env_core.sync.archive import PushArchive

    write(host / "ok.txt", "ok")
    locked = write(host / "locked.txt", "secret")
    real = PushArchive.read

    def read(path: str, st):
        if path == str(locked):
            raise PermissionError(13, "Permission denied", path)
        return real(path, st)

    monkeypatch.setattr(PushArchive, "read", staticmethod(read))
    engine = make_engine()
    result = engine.push()
    assert result.unreadable == (str(locked),)
    assert result.uploaded == ("/work/proj/ok.txt",)
    monkeypatch.setattr(PushArchive, "read", staticmethod(real))
    assert engine.push(force=True).uploaded == ("/work/proj/locked.txt",)
    assert (remote / "locked.txt").read_text() == "secret"


def test_single_file_mapping(host: Path, remote_base: Path, tmp_path: Path, make_engine) -> None:
    cred = write(tmp_path / "creds.json", '{"token": "t"}')
    engine = make_engine(SyncMapping(cred, "/root/.config/creds.json", upload_only=True))
    assert engine.push().uploaded == ("/root/.config/creds.json",)
    assert (remote_base / "root/.config/creds.json").read_text() == '{"token": "t"}'
    cred.unlink()
    assert engine.push(force=True).deleted == ("/root/.config/creds.json",)
    assert not (remote_base / "root/.config/creds.json").exists()


def test_several_mappings_share_one_upload(host: Path, remote_base: Path, tmp_path: Path, transport, make_engine) -> None:
    write(host / "a.txt", "a")
    other = tmp_path / "other"
    write(other / "b.txt", "b")
    cred = write(tmp_path / "token", "secret")
    engine = make_engine(
        SyncMapping(host, "/work/proj"),
        SyncMapping(other, "/data/other"),
        SyncMapping(cred, "/work/proj/.token", upload_only=True),
    )
    engine.push()
    assert transport.count("upload") == 1
    assert (remote_base / "work/proj/a.txt").read_text() == "a"
    assert (remote_base / "data/other/b.txt").read_text() == "b"
    assert (remote_base / "work/proj/.token").read_text() == "secret"


def test_relative_remote_paths(host: Path, remote_base: Path, make_engine) -> None:
    write(host / "a.txt", "a")
    engine = make_engine(SyncMapping(host, "~/proj"))
    engine.push()
    assert (remote_base / "proj" / "a.txt").read_text() == "a"


def test_reset_uploads_everything_again(host: Path, remote: Path, make_engine) -> None:
    write(host / "a.txt", "a")
    engine = make_engine()
    engine.push()
    (remote / "a.txt").unlink()
    engine.reset()
    assert engine.push().uploaded == ("/work/proj/a.txt",)
    assert (remote / "a.txt").exists()


def test_include_and_exclude_globs(host: Path, remote: Path, make_engine) -> None:
    write(host / "src" / "m.py")
    write(host / "src" / "m.txt")
    write(host / "build" / "out.py")
    write(host / "logs" / "x.log")
    engine = make_engine(SyncMapping(host, "/work/proj", include=("*.py", "logs/**"), exclude=("build",)))
    engine.push()
    assert sorted(snapshot(remote)) == ["logs", "logs/x.log", "src", "src/m.py"]


def test_a_transport_that_stops_reading_early_fails_the_push(host: Path, make_engine, remote_base: Path) -> None:
    from hermes_env_core.sync import LocalDirTransport

    class Lazy(LocalDirTransport):
        def upload(self, remote_root, archive, size):
            archive.read(512)  # then claims success

    for i in range(20):
        write(host / f"f{i}.txt", "x" * 1000)
    engine = make_engine(transport=Lazy(remote_base))
    with pytest.raises(TransportError, match="returned after sending 512 of"):
        engine.push()
    assert all(s.stats == {} and len(s.doubt) == 20 for s in engine._maps)  # nothing recorded


def test_a_file_that_shrinks_mid_push_fails_it_and_is_retried(host: Path, remote: Path, make_engine, monkeypatch) -> None:
    from hermes_env_core.sync import archive

    monkeypatch.setattr(archive, "_SMALL", 10)  # stream every file from disk
    big = write(host / "big.bin", os.urandom(300_000))
    write(host / "small.txt", "small file")
    real_fstat = os.fstat

    def lying_fstat(fd):
        st = real_fstat(fd)
        if st.st_size == 300_000:
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid,
                                   400_000, int(st.st_atime), int(st.st_mtime), int(st.st_ctime)))
        return st

    monkeypatch.setattr(archive.os, "fstat", lying_fstat)
    engine = make_engine()
    with pytest.raises(SyncError, match="shrank"):
        engine.push()
    monkeypatch.setattr(archive.os, "fstat", real_fstat)
    result = engine.push()
    assert sorted(result.uploaded) == ["/work/proj/big.bin", "/work/proj/small.txt"]
    assert (remote / "big.bin").read_bytes() == big.read_bytes()


def test_a_non_streaming_transport_gets_the_finished_seekable_archive(host: Path, remote_base: Path, make_engine) -> None:
    from hermes_env_core.sync import LocalDirTransport

    seen = []

    class Sdk(LocalDirTransport):
        def upload(self, remote_root, archive, size):
            assert archive.seekable()
            archive.seek(0, os.SEEK_END)
            seen.append((size, archive.tell()))
            archive.seek(0)
            super().upload(remote_root, archive, size)

    sdk = Sdk(remote_base)
    sdk.streams_upload = False  # like an SDK call that wants a length up front
    for i in range(50):
        write(host / f"f{i}.txt", f"{i}" * 500)
    engine = make_engine(transport=sdk)
    result = engine.push()
    assert seen == [(result.bytes_sent, result.bytes_sent)]
    assert len(result.uploaded) == 50 and (remote_base / "work/proj/f7.txt").read_text() == "7" * 500


def test_a_streaming_transport_starts_before_the_archive_is_finished(host: Path, remote: Path, remote_base: Path,
                                                                    make_engine, monkeypatch) -> None:
    import threading

    from hermes_env_core.sync import LocalDirTransport
    from hermes_env_core.sync.archive import PushArchive

    started = threading.Event()
    real = PushArchive.read
    reads = [0]

    def read(path, st):
        reads[0] += 1
        if reads[0] == 2:  # the second file waits until the upload has begun
            assert started.wait(10)
        return real(path, st)

    monkeypatch.setattr(PushArchive, "read", staticmethod(read))
    sizes = []

    class Recording(LocalDirTransport):
        def upload(self, remote_root, archive, size):
            sizes.append(size)
            started.set()
            super().upload(remote_root, archive, size)

    for i in range(20):
        write(host / f"f{i}.txt", str(i))
    result = make_engine(transport=Recording(remote_base)).push()
    assert sizes == [None] and len(result.uploaded) == 20
    assert sorted(os.listdir(remote)) == sorted(f"f{i}.txt" for i in range(20))
