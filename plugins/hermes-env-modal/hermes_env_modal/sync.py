"""``ModalSyncTransport``: the core sync engine's ``FileSyncTransport`` over sandbox execs.

Upload is one gzip-compressed tar stream into one ``tar -xz`` exec, its stdin
written in chunks below the SDK's per-write limit; download is one ``tar -cz``
exec whose stdout is read as bytes (the SDK's ``text=False`` mode is binary-safe).
Relative remote paths are taken from the sandbox's ``$HOME``.
"""

from __future__ import annotations

import gzip
import io
import shlex
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from hermes_env_core.errors import EnvironmentUnavailable, HermesEnvError
from hermes_env_core.sync import CommandFailedError, CommandTransport, TransportError

from ._stream import EXIT_STATUS_WAIT_S

if TYPE_CHECKING:
    from .direct import DirectModalEnvironment

__all__ = ["ModalSyncTransport"]

_READ = 256 * 1024  # bytes of the uncompressed archive read at a time
_SEND = 1024 * 1024  # compressed bytes per stdin write RPC (the SDK takes at most 16 MiB)
_SPOOL = 16 * 1024 * 1024  # downloaded archives larger than this go to a temp file


def _q(path: str) -> str:
    return shlex.quote(path or ".")


def _home(script: str) -> str:
    return 'cd -- "$HOME" 2>/dev/null || cd /; ' + script


def _run(env: DirectModalEnvironment, script: str, stdin: Iterable[bytes], sink: Any) -> None:
    """Run ``script`` under ``sh`` on an exec of its own: ``stdin`` written (then EOF), stdout into
    ``sink``; ``CommandFailedError`` for a non-zero exit."""
    try:
        stream = env.open_stream(["sh", "-c", _home(script)], stderr=True)
    except HermesEnvError as exc:
        raise TransportError(f"modal sync: {exc}", transient=isinstance(exc, EnvironmentUnavailable)) from exc
    try:
        for chunk in stdin:
            stream.write(chunk)
        stream.finish_input()
        while data := stream.read(_READ):
            sink.write(data)
        code = stream.exit_status.result(EXIT_STATUS_WAIT_S)
    except (OSError, HermesEnvError):  # a broken stream (transient for the engine), no exit status in time
        raise
    except Exception as exc:
        raise _transport_error(env, exc) from exc
    finally:
        stream.close()
    if code != 0:
        raise CommandFailedError(script, code, bytes(stream.stderr))


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
    def upload(self, remote_root: str, archive: BinaryIO, size: int | None) -> None:
        root = _q(remote_root)
        script = f"mkdir -p -- {root} && cd -- {root} && exec tar -x -z -o -f -"
        _run(self._env, script, self._gzip(archive), io.BytesIO())

    def _gzip(self, archive: BinaryIO) -> Iterator[bytes]:
        z = zlib.compressobj(self._level, zlib.DEFLATED, 31)  # 31: gzip framing
        pending = bytearray()
        while block := archive.read(_READ):
            pending += z.compress(block)
            if len(pending) >= _SEND:
                yield bytes(pending)
                pending.clear()
        yield bytes(pending + z.flush())

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
        spool = tempfile.SpooledTemporaryFile(_SPOOL)  # noqa: SIM115 - handed on, or closed
        try:
            _run(self._env, "; ".join(parts), (), spool)
        except BaseException:
            spool.close()
            raise
        spool.seek(0)
        if not spool.read(1):
            spool.close()
            return None
        spool.seek(0)
        return _Gunzip(spool)  # type: ignore[return-value]

    # -- for CommandTransport (deletes) ---------------------------------------------------
    def _runner(self, script: str, stdin: bytes | BinaryIO | None) -> bytes:
        data = stdin.read() if stdin is not None and not isinstance(stdin, (bytes, bytearray)) else stdin or b""
        out = io.BytesIO()
        _run(self._env, script, (data[i : i + _SEND] for i in range(0, len(data), _SEND)), out)
        return out.getvalue()


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
