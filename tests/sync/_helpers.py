"""Helpers for the sync tests: a transport wrapper that records calls and
injects failures, a fake clock, tree snapshots and hostile tar builders."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class RecordingTransport:
    """Wraps a transport: records each call, and runs ``fail`` hooks first.

    A hook gets (operation, args) and may raise to simulate a failure.
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[str, tuple]] = []
        self.hooks: list[Callable[[str, tuple], None]] = []
        self.downloads: list[bytes] = []  # when set, served instead of the inner tree

    def _hook(self, op: str, args: tuple) -> None:
        self.calls.append((op, args))
        for hook in list(self.hooks):
            hook(op, args)

    def count(self, op: str) -> int:
        return sum(1 for c in self.calls if c[0] == op)

    def upload(self, remote_root: str, archive: BinaryIO, size: int | None) -> None:
        self._hook("upload", (remote_root, size))
        self.inner.upload(remote_root, archive, size)

    def delete(self, remote_root, files, dirs=()):
        self._hook("delete", (remote_root, tuple(files), tuple(dirs)))
        self.inner.delete(remote_root, files, dirs)

    def download(self, remote_root, subpath=None, exclude=()):
        self._hook("download", (remote_root, subpath))
        if self.downloads:
            return io.BytesIO(self.downloads.pop(0))
        return self.inner.download(remote_root, subpath, exclude)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, data: str | bytes = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def bump(path: Path, data: str | bytes) -> None:
    """Rewrite ``path`` so that (mtime_ns, size) surely changes."""
    st = path.stat()
    write(path, data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every entry under ``root``: kind and content (or link target)."""
    out: dict[str, tuple[str, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", "")
            else:
                out[rel] = ("file", p.read_bytes())
    return out




# -- archives for pull-back tests ------------------------------------------------


def tar_bytes(*members: tuple[tarfile.TarInfo, bytes | None], end: bool = True) -> bytes:
    """A tar stream of (header, data) pairs; ``end=False`` leaves off the end blocks."""
    buf = io.BytesIO()
    for ti, data in members:
        buf.write(ti.tobuf(tarfile.GNU_FORMAT))
        if data:
            buf.write(data)
            pad = (-len(data)) % 512
            buf.write(b"\0" * pad)
    if end:
        buf.write(b"\0" * 1024)
    return buf.getvalue()


def member(name: str, data: bytes = b"", *, type: bytes = tarfile.REGTYPE, linkname: str = "",
           size: int | None = None, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes | None]:
    ti = tarfile.TarInfo(name)
    ti.type = type
    ti.mode = mode
    ti.mtime = 1_700_000_000
    ti.linkname = linkname
    ti.size = len(data) if size is None else size
    if type != tarfile.REGTYPE:
        ti.size = 0 if size is None else size
    return ti, data
