"""How the sync engine moves bytes: the ``FileSyncTransport`` protocol and two
implementations, one over any command runner (SSH, Docker, cloud) and one over a
local directory (tests).

A transport only moves tar streams and deletes paths; deciding *what* to move is
the engine's job, so a backend never does change detection of its own.
"""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, Protocol, cast, runtime_checkable

from ..errors import EnvironmentUnavailable, SyncError, UnsafeArchiveError

__all__ = [
    "CommandFailedError",
    "CommandRunner",
    "CommandTransport",
    "FileSyncTransport",
    "LocalDirTransport",
    "SubprocessRunner",
    "TransportError",
    "is_transient",
]

_CHUNK = 256 * 1024
_ARGV_BUDGET = 64 * 1024  # bytes of quoted directory names per rmdir command


class TransportError(SyncError):
    """Moving files to or from the target failed.

    ``transient`` errors (connection dropped, timeout) are retried by the engine
    with backoff; the others (a command that ran and failed) are not.
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class CommandFailedError(TransportError):
    """A transport command ran in the target and exited non-zero."""

    def __init__(self, script: str, exit_code: int, stderr: bytes | str = b"") -> None:
        text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
        text = text.strip()
        short = script if len(script) <= 200 else script[:200] + "..."
        super().__init__(f"sync command exited {exit_code}: {short}" + (f": {text[-2000:]}" if text else ""))
        self.script = script
        self.exit_code = exit_code
        self.stderr = text


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same transfer may succeed."""
    if isinstance(exc, TransportError):
        return exc.transient
    if isinstance(exc, (UnsafeArchiveError, SyncError)):
        return False
    return isinstance(exc, (ConnectionError, TimeoutError, EOFError, EnvironmentUnavailable, OSError))


@runtime_checkable
class FileSyncTransport(Protocol):
    """Bulk file movement into and out of one target.

    ``remote_root`` is an absolute path in the target, or a relative one taken
    from the target's default directory (its home for SSH). Member names in
    every tar stream are relative to it. Raise ``TransportError`` (with
    ``transient=True`` for connection trouble) or ``OSError``; nothing else
    should escape for an ordinary failure.

    A transport may set ``streams_upload = True`` to be handed the push
    archive while it is still being written (``size`` None, ``read()`` blocks
    for more); otherwise ``upload`` gets the finished, seekable archive.
    """

    def upload(self, remote_root: str, archive: BinaryIO, size: int | None) -> None:
        """Extract the uncompressed tar stream ``archive`` under ``remote_root``,
        creating it, in ONE operation (one channel, one exec). ``size`` is the
        stream's length, or None when ``streams_upload`` is set and the engine
        is still writing it (``read()`` then waits for more; ``read(-1)``
        returns all of it). Read the stream to its end before returning.
        Existing files are replaced; modes and mtimes come from the archive."""
        ...

    def delete(self, remote_root: str, files: Sequence[str], dirs: Sequence[str] = ()) -> None:
        """Remove ``files`` (regular files or symlinks; missing ones ignored), then
        each of ``dirs`` (given deepest first) if it is empty, under ``remote_root``."""
        ...

    def download(self, remote_root: str, subpath: str | None = None, exclude: Sequence[str] = ()) -> BinaryIO | None:
        """The tree at ``remote_root`` (or only ``subpath`` inside it) as ONE
        uncompressed tar stream, or None when that path does not exist.
        Links are stored as links, never followed. ``exclude`` holds component
        globs the target may leave out (the engine filters again, so ignoring
        them is allowed). The engine reads the stream to EOF or closes it."""
        ...


class CommandRunner(Protocol):
    """Runs one POSIX ``sh`` command line in the target with raw stdin.

    ``stdin`` is bytes, a binary file object to read to EOF (only when the
    transport was made with ``stream_stdin=True``), or None (empty stdin).
    Returns the command's raw stdout, never decoded: bytes once the command has
    exited 0, or a binary file object whose ``read()`` raises
    ``CommandFailedError`` at EOF if the exit code was not 0. Raises
    ``CommandFailedError`` for a non-zero exit and ``TransportError(...,
    transient=True)`` (or ``OSError``) when the connection failed.
    """

    def __call__(self, script: str, stdin: bytes | BinaryIO | None) -> bytes | BinaryIO: ...


def _q(path: str) -> str:
    return shlex.quote(path)


def _drain(out: bytes | BinaryIO) -> None:
    if isinstance(out, (bytes, bytearray, memoryview)):
        return
    try:
        while out.read(_CHUNK):
            pass
    finally:
        out.close()


class CommandTransport:
    """``FileSyncTransport`` over anything that can run a shell command with
    stdin: ``tar -x`` fed through stdin, ``xargs -0 rm -f --`` for deletes and
    ``tar -c`` on stdout for downloads. Needs ``sh``, ``tar`` and ``xargs`` in
    the target (GNU or BusyBox).
    """

    def __init__(self, run: CommandRunner, *, stream_stdin: bool = False, tar: str = "tar") -> None:
        self._run = run
        self._stream = stream_stdin
        self._tar = tar
        #: a streaming runner takes the archive while the engine still writes it
        self.streams_upload = stream_stdin

    def upload(self, remote_root: str, archive: BinaryIO, size: int | None) -> None:
        root = _q(remote_root or ".")
        script = f"mkdir -p -- {root} && cd -- {root} && exec {self._tar} -x -o -f -"
        stdin: bytes | BinaryIO = archive if self._stream else archive.read()
        _drain(self._run(script, stdin))

    def delete(self, remote_root: str, files: Sequence[str], dirs: Sequence[str] = ()) -> None:
        root = _q(remote_root or ".")
        head = f"cd -- {root} 2>/dev/null || exit 0"
        if files:
            payload = b"".join(os.fsencode(f) + b"\0" for f in files)
            _drain(self._run(f"{head}; exec xargs -0 rm -f --", payload))
        batch: list[str] = []
        used = 0
        for d in dirs:
            batch.append(_q(d))
            used += len(batch[-1]) + 1
            if used > _ARGV_BUDGET:
                self._rmdir(head, batch)
                batch, used = [], 0
        if batch:
            self._rmdir(head, batch)

    def _rmdir(self, head: str, quoted: list[str]) -> None:
        # rmdir refuses non-empty directories: files the target added stay.
        _drain(self._run(f"{head}; rmdir -- {' '.join(quoted)} 2>/dev/null; exit 0", None))

    def download(self, remote_root: str, subpath: str | None = None, exclude: Sequence[str] = ()) -> BinaryIO | None:
        root = _q(remote_root or ".")
        parts = [f"cd -- {root} 2>/dev/null || exit 0"]
        target = "."
        if subpath:
            target = _q(subpath)
            parts.append(f"{{ [ -e {target} ] || [ -L {target} ]; }} || exit 0")
        excl = " ".join(f"--exclude={_q(p)}" for p in exclude)
        # GNU tar exits 1 when a file changed while it was read; the archive is still whole.
        parts.append(f"{self._tar} -c -f - {excl} -- {target}; rc=$?; [ $rc -eq 1 ] && rc=0; exit $rc")
        out = self._run("; ".join(parts), None)
        stream: BinaryIO = io.BytesIO(out) if isinstance(out, (bytes, bytearray, memoryview)) else out
        first = stream.read(512)
        if not first:
            stream.close()
            return None
        return cast(BinaryIO, _Prefixed(first, stream))


class _Prefixed(io.RawIOBase):
    """A stream with its first block already read back in front."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n is None or n < 0:
                data, self._head = self._head + self._rest.read(), b""
                return data
            data, self._head = self._head[:n], self._head[n:]
            return data
        return self._rest.read(n)

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            self._rest.close()
        finally:
            super().close()


class _ProcStream(io.RawIOBase):
    """stdout of a child process; at EOF, the exit code is checked."""

    def __init__(self, proc: subprocess.Popen[bytes], script: str, stderr: list[bytes]) -> None:
        self._proc = proc
        self._script = script
        self._stderr = stderr
        self.threads: list[threading.Thread] = []
        self.feed_errors: list[BaseException] = []
        self._done = False

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        assert self._proc.stdout is not None
        data = self._proc.stdout.read() if n is None or n < 0 else self._proc.stdout.read1(n)  # type: ignore[attr-defined]
        if not data and not self._done:
            self._finish()
        return data

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def _finish(self) -> None:
        self._done = True
        code = self._proc.wait()
        for t in self.threads:
            t.join()
        if self.feed_errors:
            exc = self.feed_errors[0]
            raise exc if isinstance(exc, SyncError) else TransportError(f"feeding stdin failed: {exc!r}")
        if code != 0:
            raise CommandFailedError(self._script, code, b"".join(self._stderr))

    def close(self) -> None:
        if not self._done:
            self._done = True
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for t in self.threads:
                t.join()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        super().close()


class SubprocessRunner:
    """``CommandRunner`` that runs ``[*argv_prefix, script]`` as a local child,
    e.g. ``("sh", "-c")`` here or ``("docker", "exec", "-i", cid, "sh", "-c")``.
    stdin is fed from a thread and stdout streamed, so neither side blocks."""

    def __init__(self, argv_prefix: Sequence[str] = ("sh", "-c"), *, cwd: str | os.PathLike[str] | None = None) -> None:
        self.argv_prefix = tuple(argv_prefix)
        self.cwd = cwd

    def __call__(self, script: str, stdin: bytes | BinaryIO | None) -> BinaryIO:
        try:
            proc = subprocess.Popen(
                [*self.argv_prefix, script],
                cwd=self.cwd,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            raise TransportError(f"cannot start {self.argv_prefix[0]!r}: {exc}", transient=False) from exc
        err: list[bytes] = []
        stream = _ProcStream(proc, script, err)
        stream.threads.append(threading.Thread(target=_collect, args=(proc.stderr, err), daemon=True))
        if stdin is not None:
            stream.threads.append(threading.Thread(target=_feed, args=(proc, stdin, stream.feed_errors), daemon=True))
        for t in stream.threads:
            t.start()
        return stream  # type: ignore[return-value]


def _collect(pipe: BinaryIO, sink: list[bytes]) -> None:
    with pipe:
        for chunk in iter(lambda: pipe.read(65536), b""):
            sink.append(chunk)


def _feed(proc: subprocess.Popen[bytes], data: bytes | BinaryIO, errors: list[BaseException]) -> None:
    pipe = proc.stdin
    assert pipe is not None
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            pipe.write(data)
        else:
            for chunk in iter(lambda: data.read(_CHUNK), b""):
                pipe.write(chunk)
    except (BrokenPipeError, ValueError):
        pass  # the command exited early; its exit code tells why
    except BaseException as exc:  # noqa: BLE001 - the stream failed: the command must not succeed
        errors.append(exc)
        proc.kill()
    finally:
        try:
            pipe.close()
        except OSError:
            pass


class LocalDirTransport:
    """A transport whose "remote" is a directory on this machine, driven by the
    real ``tar`` binary through ``CommandTransport``. Remote paths, absolute or
    not, are taken inside ``base``."""

    def __init__(self, base: str | os.PathLike[str]) -> None:
        self.base = Path(base)
        self._commands = CommandTransport(SubprocessRunner(("sh", "-c"), cwd=self.base), stream_stdin=True)
        self.streams_upload = True

    def path(self, remote: str) -> Path:
        """Where the remote path ``remote`` lives on this machine."""
        rel = remote.lstrip("/")
        return self.base / rel if rel not in ("", ".") else self.base

    def upload(self, remote_root: str, archive: BinaryIO, size: int | None) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self._commands.upload(str(self.path(remote_root)), archive, size)

    def delete(self, remote_root: str, files: Sequence[str], dirs: Sequence[str] = ()) -> None:
        if not self.base.is_dir():
            return
        self._commands.delete(str(self.path(remote_root)), files, dirs)

    def download(self, remote_root: str, subpath: str | None = None, exclude: Sequence[str] = ()) -> BinaryIO | None:
        if not self.base.is_dir():
            return None
        return self._commands.download(str(self.path(remote_root)), subpath, exclude)
