"""A ``CommandRunner`` over raw paramiko exec channels, for SSH transports.

Each call is one exec channel on a shared ``paramiko.Transport``; stdin and
stdout are raw bytes in both directions (no pty, no decoding), streamed.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import SyncError
from .transport import CommandFailedError, TransportError

if TYPE_CHECKING:  # paramiko is the optional ``ssh`` extra
    import paramiko

__all__ = ["ParamikoRunner"]

_CHUNK = 256 * 1024


class ParamikoRunner:
    """Runs sync commands through ``exec_command`` on a paramiko Transport.

    ``transport`` is a connected ``paramiko.Transport`` or a callable returning
    one (so a backend can hand out a reconnected Transport after a drop; the
    engine retries a dropped transfer). ``timeout`` bounds each wait for data.
    Use with ``CommandTransport(runner, stream_stdin=True)``.
    """

    def __init__(self, transport: paramiko.Transport | Callable[[], paramiko.Transport], *,
                 timeout: float | None = 300.0) -> None:
        self._get: Callable[[], Any] = transport if callable(transport) and not hasattr(transport, "open_session") else (lambda: transport)
        self.timeout = timeout

    def __call__(self, script: str, stdin: bytes | BinaryIO | None) -> BinaryIO:
        import paramiko

        try:
            transport = self._get()
            chan = transport.open_session(timeout=self.timeout)
            chan.settimeout(self.timeout)
            chan.exec_command(script)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise TransportError(f"ssh: cannot run a sync command: {exc}", transient=True) from exc
        stream = _ChannelStream(chan, script)
        stream.start(stdin)
        return stream  # type: ignore[return-value]


class _ChannelStream(io.RawIOBase):
    """stdout of one exec channel; at EOF the exit status is checked."""

    def __init__(self, chan: Any, script: str) -> None:
        self._chan = chan
        self._script = script
        self._stderr: list[bytes] = []
        self._errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []
        self._done = False

    def start(self, stdin: bytes | BinaryIO | None) -> None:
        t = threading.Thread(target=self._read_stderr, daemon=True)
        self._threads.append(t)
        t.start()
        if stdin is None:
            self._chan.shutdown_write()
        else:
            w = threading.Thread(target=self._feed, args=(stdin,), daemon=True)
            self._threads.append(w)
            w.start()

    def _feed(self, data: bytes | BinaryIO) -> None:
        chan = self._chan
        try:
            if isinstance(data, (bytes, bytearray, memoryview)):
                view = memoryview(data)
                for i in range(0, len(view), _CHUNK):
                    chan.sendall(view[i : i + _CHUNK])
            else:
                for chunk in iter(lambda: data.read(_CHUNK), b""):
                    chan.sendall(chunk)
            chan.shutdown_write()
        except BaseException as exc:  # noqa: BLE001 - reported by read() at EOF
            if not chan.exit_status_ready():
                # The stream broke: the command must not see a clean EOF and succeed.
                self._errors.append(exc)
                chan.close()

    def _read_stderr(self) -> None:
        try:
            for chunk in iter(lambda: self._chan.recv_stderr(65536), b""):
                self._stderr.append(chunk)
        except BaseException as exc:  # noqa: BLE001
            self._errors.append(exc)

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self._done:
            return b""
        try:
            if n is None or n < 0:
                parts = []
                for chunk in iter(lambda: self._chan.recv(_CHUNK), b""):
                    parts.append(chunk)
                data = b"".join(parts)
                if data:
                    self._finish()
                    return data
            else:
                data = self._chan.recv(min(n, _CHUNK))
        except OSError as exc:  # socket.timeout included
            self._abort()
            raise TransportError(f"ssh: sync command lost its channel: {exc}", transient=True) from exc
        if not data:
            self._finish()
        return data

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def _finish(self) -> None:
        self._done = True
        chan = self._chan
        if not chan.status_event.wait(self.timeout_s):
            self._abort()
            raise TransportError("ssh: no exit status for a sync command", transient=True)
        for t in self._threads:
            t.join(self.timeout_s)
        code = chan.recv_exit_status()
        chan.close()
        if self._errors and isinstance(self._errors[0], SyncError):
            raise self._errors[0]
        if code == -1:
            raise TransportError("ssh: the connection closed before a sync command finished", transient=True)
        if code != 0:
            raise CommandFailedError(self._script, code, b"".join(self._stderr))
        if self._errors:
            raise TransportError(f"ssh: sync command stream failed: {self._errors[0]!r}", transient=True)

    @property
    def timeout_s(self) -> float | None:
        timeout: float | None = self._chan.gettimeout()
        return timeout

    def _abort(self) -> None:
        self._done = True
        try:
            self._chan.close()
        except Exception:  # noqa: BLE001 - already broken
            pass

    def close(self) -> None:
        if not self._done:
            self._abort()
        super().close()
