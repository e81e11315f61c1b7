"""CommandTransport over local shells: raw bytes both ways, odd names, errors."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from hermes_env_core.errors import SyncError, UnsafeArchiveError
from hermes_env_core.sync import (
    CommandFailedError,
    CommandTransport,
    FileSyncTransport,
    LocalDirTransport,
    SubprocessRunner,
    SyncEngine,
    SyncMapping,
    TransportError,
)
from hermes_env_core.sync.transport import is_transient
from tests.sync._helpers import snapshot, write

ODD_NAMES = ["plain.txt", "with space", "-leading-dash", "new\nline", "tab\tand'quote\"", "ünïcødé", os.fsdecode(b"raw-\xff\xfe")]
BLOB = bytes(range(256)) * 64 + b"\r\n\r\n\0\0"


def bytes_runner(cwd: Path):
    """A runner like an SDK's: whole stdin in, whole stdout back as bytes."""

    def run(script: str, stdin):
        assert stdin is None or isinstance(stdin, bytes)
        r = subprocess.run(["sh", "-c", script], input=stdin, capture_output=True, cwd=cwd)
        if r.returncode:
            raise CommandFailedError(script, r.returncode, r.stderr)
        return r.stdout

    return run


def _archive(files: dict[str, bytes]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    buf.seek(0)
    return buf


@pytest.fixture(params=["streaming", "bytes"])
def cmd_transport(request, tmp_path: Path) -> CommandTransport:
    if request.param == "streaming":
        return CommandTransport(SubprocessRunner(cwd=tmp_path), stream_stdin=True)
    return CommandTransport(bytes_runner(tmp_path))


def test_transports_satisfy_the_protocol(cmd_transport, tmp_path: Path) -> None:
    assert isinstance(cmd_transport, FileSyncTransport)
    assert isinstance(LocalDirTransport(tmp_path), FileSyncTransport)


def test_round_trip_is_binary_safe_with_odd_names(cmd_transport, tmp_path: Path) -> None:
    files = {f"d/{n}": BLOB + n.encode("utf-8", "surrogateescape") for n in ODD_NAMES}
    arch = _archive(files)
    cmd_transport.upload(str(tmp_path / "root"), arch, len(arch.getvalue()))
    for name, data in files.items():
        assert (tmp_path / "root" / name).read_bytes() == data
    stream = cmd_transport.download(str(tmp_path / "root"))
    assert stream is not None
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        got = {ti.name.removeprefix("./"): tf.extractfile(ti).read() for ti in tf if ti.isreg()}
    assert got == files


def test_download_missing_root_or_subpath_is_none(cmd_transport, tmp_path: Path) -> None:
    assert cmd_transport.download(str(tmp_path / "nope")) is None
    (tmp_path / "there").mkdir()
    assert cmd_transport.download(str(tmp_path / "there"), "nope.txt") is None
    write(tmp_path / "there" / "f.txt", "f")
    stream = cmd_transport.download(str(tmp_path / "there"), "f.txt")
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        assert [ti.name for ti in tf] == ["f.txt"]


def test_download_of_an_empty_root_is_an_archive(cmd_transport, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    stream = cmd_transport.download(str(tmp_path / "empty"))
    assert stream is not None
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        assert [ti.name for ti in tf] == ["."]


def test_download_applies_exclude_hints(cmd_transport, tmp_path: Path) -> None:
    write(tmp_path / "r" / "keep.txt")
    write(tmp_path / "r" / "a" / "node_modules" / "big.js")
    write(tmp_path / "r" / "x.pyc")
    stream = cmd_transport.download(str(tmp_path / "r"), exclude=("node_modules", "*.pyc"))
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        names = sorted(ti.name for ti in tf)
    assert names == [".", "./a", "./keep.txt"]


def test_delete_files_then_empty_dirs(cmd_transport, tmp_path: Path) -> None:
    root = tmp_path / "r"
    for n in ODD_NAMES:
        write(root / "d" / n)
    write(root / "full" / "stays.txt")
    write(root / "full" / "goes.txt")
    cmd_transport.delete(
        str(root),
        [f"d/{n}" for n in ODD_NAMES] + ["full/goes.txt", "never-existed"],
        ["d", "full"],
    )
    assert snapshot(root) == {"full": ("dir", ""), "full/stays.txt": ("file", b"x")}
    cmd_transport.delete(str(tmp_path / "no-such-root"), ["x"], ["y"])  # a missing root is fine


def test_failed_command_raises_with_stderr(cmd_transport, tmp_path: Path) -> None:
    write(tmp_path / "blocker", "a file where a directory should be")
    arch = _archive({"x": b"x"})
    with pytest.raises(CommandFailedError) as info:
        cmd_transport.upload(str(tmp_path / "blocker"), arch, 0)
    assert info.value.exit_code != 0
    assert "blocker" in info.value.stderr
    assert not info.value.transient


def test_garbage_instead_of_a_tar_stream(tmp_path: Path) -> None:
    t = CommandTransport(lambda script, stdin: b"this is not a tar archive" * 40)
    engine = SyncEngine(t, [SyncMapping(tmp_path / "h", "/x")], lock_dir=str(tmp_path / "locks"))
    with pytest.raises(SyncError) as info:
        engine.pull()
    assert not isinstance(info.value, UnsafeArchiveError)
    assert not (tmp_path / "h").exists()


def test_transient_classification() -> None:
    assert is_transient(TransportError("x", transient=True))
    assert not is_transient(TransportError("x"))
    assert not is_transient(CommandFailedError("tar", 2, b"no space"))
    assert not is_transient(UnsafeArchiveError("x"))
    assert is_transient(ConnectionResetError())
    assert is_transient(EOFError())
    assert not is_transient(ValueError())


def test_engine_over_a_bytes_runner(tmp_path: Path) -> None:
    """The shape a cloud SDK backend uses: no streaming at all."""
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    host = tmp_path / "host"
    write(host / "a.bin", BLOB)
    engine = SyncEngine(CommandTransport(bytes_runner(sandbox)), [SyncMapping(host, "proj")], lock_dir=str(tmp_path / "l"))
    engine.push()
    assert (sandbox / "proj" / "a.bin").read_bytes() == BLOB
    write(sandbox / "proj" / "out.bin", BLOB[::-1])
    assert engine.pull().created == (str(host / "out.bin"),)
    assert (host / "out.bin").read_bytes() == BLOB[::-1]
