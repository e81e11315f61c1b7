"""``ModalSyncTransport``: the core sync engine's ``FileSyncTransport`` over sandbox execs.

Upload is one gzip-compressed tar stream into one ``tar -xz`` exec, its stdin
written in chunks below the SDK's per-write limit; download is one ``tar -cz``
exec whose stdout is read as bytes (the SDK's ``text=False`` mode is binary-safe).
Relative remote paths are taken from the sandbox's ``$HOME``.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import shlex
import tempfile
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from hermes_env_core.errors import EnvironmentUnavailable, HermesEnvError
from hermes_env_core.sync import CommandFailedError, CommandTransport, TransportError

if TYPE_CHECKING:
    from .direct import DirectModalEnvironment

__all__ = ["ModalSyncTransport"]

_READ = 256 * 1024  # bytes of the uncompressed archive read at a time
_SEND = 1024 * 1024  # compressed bytes per stdin write RPC (the SDK takes at most 16 MiB)
_SPOOL = 16 * 1024 * 1024  # downloaded archives larger than this go to a temp file
_CALL_S = 600.0


def _q(path: str) -> str:
    return shlex.quote(path or ".")


def _home(script: str) -> str:
    return 'cd -- "$HOME" 2>/dev/null || cd /; ' + script


class _Exec:
    """One ``sh -c`` exec whose stdin is fed from the calling thread and whose
    stdout and stderr are collected on the loop (stdout spooled to disk past 16 MiB)."""

    def __init__(self, env: DirectModalEnvironment, script: str, *, keep_stdout: bool) -> None:
        self._env = env
        self.script = script
        self._keep = keep_stdout
        self.stdout: Any = tempfile.SpooledTemporaryFile(_SPOOL) if keep_stdout else None  # noqa: SIM115 - closed by close()
        self._stderr = bytearray()
        self._proc: Any = None
        self._readers: list[asyncio.Future[Any]] = []
        self._run(self._open())

    def _run(self, coro: Any) -> Any:
        try:
            return self._env._loop.run(coro, timeout=_CALL_S)
        except HermesEnvError as exc:
            raise TransportError(f"modal sync: {exc}", transient=isinstance(exc, EnvironmentUnavailable)) from exc
        except Exception as exc:
            raise _transport_error(self._env, exc) from exc

    async def _open(self) -> None:
        self._proc = await self._env.open_exec(["sh", "-c", _home(self.script)])

        async def collect(stream: Any, sink: Any) -> None:
            async for chunk in stream:
                sink.write(chunk)

        out_sink = self.stdout if self._keep else io.BytesIO()
        self._readers = [
            asyncio.ensure_future(collect(self._proc.stdout, out_sink)),
            asyncio.ensure_future(collect(self._proc.stderr, _ByteSink(self._stderr))),
        ]

    def write(self, data: bytes) -> None:
        if data:
            self._run(self._write(data, eof=False))

    async def _write(self, data: bytes, *, eof: bool) -> None:
        if data:
            self._proc.stdin.write(data)
        if eof:
            self._proc.stdin.write_eof()
        await self._proc.stdin.drain.aio()

    def finish(self, *, stdin_used: bool) -> int:
        """Close stdin, wait for the exit; raises ``CommandFailedError`` for a non-zero one."""
        code = self._run(self._finish(stdin_used))
        if code != 0:
            self.close()
            raise CommandFailedError(self.script, code, bytes(self._stderr))
        if self.stdout is not None:
            self.stdout.seek(0)
        return code

    async def _finish(self, stdin_used: bool) -> int:
        if stdin_used:
            await self._write(b"", eof=True)
        code = await self._proc.wait.aio()
        await asyncio.gather(*self._readers)
        return int(code)

    def close(self) -> None:
        for reader in self._readers:
            if not reader.done():
                self._env._loop.call_soon(reader.cancel)
        if self.stdout is not None:
            self.stdout.close()


class _ByteSink:
    def __init__(self, buf: bytearray) -> None:
        self._buf = buf

    def write(self, data: bytes) -> None:
        if len(self._buf) < 64 * 1024:
            self._buf += data


def _transport_error(env: DirectModalEnvironment, exc: BaseException) -> TransportError:
    modal = getattr(env, "_modal", None)
    gone = modal is not None and isinstance(exc, (modal.exception.NotFoundError, modal.exception.InvalidError))
    return TransportError(f"modal sync: {type(exc).__name__}: {exc}", transient=not gone)


class ModalSyncTransport:
    """Moves tar streams into and out of one direct-mode sandbox."""

    def __init__(self, env: DirectModalEnvironment, *, compresslevel: int = 6) -> None:
        self._env = env
        self._level = compresslevel
        self._commands = CommandTransport(self._runner, stream_stdin=False)

    # -- FileSyncTransport ------------------------------------------------------------
    def upload(self, remote_root: str, archive: BinaryIO, size: int) -> None:
        root = _q(remote_root)
        script = f"mkdir -p -- {root} && cd -- {root} && exec tar -x -z -o -f -"
        job = _Exec(self._env, script, keep_stdout=False)
        try:
            z = zlib.compressobj(self._level, zlib.DEFLATED, 31)  # 31: gzip framing
            pending = bytearray()
            while True:
                block = archive.read(_READ)
                if not block:
                    break
                pending += z.compress(block)
                if len(pending) >= _SEND:
                    job.write(bytes(pending))
                    pending.clear()
            pending += z.flush()
            job.write(bytes(pending))
            job.finish(stdin_used=True)
        except BaseException:
            job.close()
            raise

    def delete(self, remote_root: str, files: Sequence[str], dirs: Sequence[str] = ()) -> None:
        self._commands.delete(remote_root, files, dirs)

    def download(self, remote_root: str, subpath: str | None = None, exclude: Sequence[str] = ()) -> BinaryIO | None:
        parts = [f"cd -- {_q(remote_root)} 2>/dev/null || exit 0"]
        target = "."
        if subpath:
            target = _q(subpath)
            parts.append(f"{{ [ -e {target} ] || [ -L {target} ]; }} || exit 0")
        excl = " ".join(f"--exclude={shlex.quote(p)}" for p in exclude)
        # GNU tar exits 1 when a file changed while it was read; the archive is still whole.
        parts.append(f"tar -c -z -f - {excl} -- {target}; rc=$?; [ $rc -eq 1 ] && rc=0; exit $rc")
        job = _Exec(self._env, "; ".join(parts), keep_stdout=True)
        try:
            job.finish(stdin_used=False)
        except BaseException:
            job.close()
            raise
        spool = job.stdout
        if not spool.read(1):
            spool.close()
            return None
        spool.seek(0)
        return _Gunzip(spool)  # type: ignore[return-value]

    # -- for CommandTransport (deletes) ---------------------------------------------------
    def _runner(self, script: str, stdin: bytes | BinaryIO | None) -> bytes:
        job = _Exec(self._env, script, keep_stdout=True)
        try:
            if stdin is not None:
                data = stdin if isinstance(stdin, (bytes, bytearray)) else stdin.read()
                for start in range(0, len(data), _SEND):
                    job.write(bytes(data[start : start + _SEND]))
            job.finish(stdin_used=stdin is not None)
            return job.stdout.read()
        finally:
            job.close()


class _Gunzip(io.RawIOBase):
    """The uncompressed tar stream of a downloaded archive; closing it frees the spool."""

    def __init__(self, spool: Any) -> None:
        self._spool = spool
        self._gz = gzip.GzipFile(fileobj=spool, mode="rb")

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        try:
            return self._gz.read(n)
        except (OSError, EOFError, zlib.error) as exc:
            raise TransportError(f"modal sync: the downloaded archive is corrupt: {exc}") from exc

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            self._gz.close()
            self._spool.close()
        finally:
            super().close()
