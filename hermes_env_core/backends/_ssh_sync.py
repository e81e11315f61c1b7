"""The sync engine's ``FileSyncTransport`` over an SSH environment's connection.

``CommandTransport`` decides the commands (tar in, tar out, xargs rm); this runs
each on ONE channel of the environment's Transport, stdin streamed, stdout raw.
"""

from __future__ import annotations

import io
import logging
import shlex
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import EnvironmentUnavailable
from ..sync.transport import CommandFailedError, CommandTransport, TransportError
from .ssh import SSHAuthenticationError, SSHHostKeyError, _workers

if TYPE_CHECKING:
    import paramiko

    from .ssh import SSHEnvironment

__all__ = ["SSHCommandRunner", "SSHSyncTransport"]

log = logging.getLogger(__name__)

_CHUNK = 256 * 1024
# Start-up files of the login shell may print; the stream starts after this line.
_GO = b"\x1ehermes-sync-go\n"
_GO_CMD = "command printf '\\036hermes-sync-go\\n'; "


class SSHSyncTransport(CommandTransport):
    """``FileSyncTransport`` for an ``SSHEnvironment``: one channel per operation."""

    def __init__(self, env: SSHEnvironment) -> None:
        super().__init__(SSHCommandRunner(env), stream_stdin=True)


class SSHCommandRunner:
    """``CommandRunner``: a POSIX sh command on the environment's connection."""

    def __init__(self, env: SSHEnvironment) -> None:
        self._env = env

    def __call__(self, script: str, stdin: bytes | BinaryIO | None) -> BinaryIO:
        env = self._env
        command = _GO_CMD + (f"exec sh -c {shlex.quote(script)}" if not env._bash_login else script)
        if stdin is None:
            command = "exec </dev/null; " + command
        try:
            chan = env._open(command, combine=False)
        except (SSHHostKeyError, SSHAuthenticationError) as exc:
            raise TransportError(str(exc), transient=False) from exc
        except EnvironmentUnavailable as exc:
            raise TransportError(f"ssh sync: {exc}", transient=True) from exc
        stream = _ChannelStream(env, chan, script)
        if stdin is not None:
            _workers.submit(_feed, chan, stdin)
        return stream  # type: ignore[return-value]


def _feed(chan: paramiko.Channel, data: bytes | BinaryIO) -> None:
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            chan.sendall(data)
        else:
            for chunk in iter(lambda: data.read(_CHUNK), b""):
                chan.sendall(chunk)
        chan.shutdown_write()
    except Exception as exc:  # noqa: BLE001 - the command's exit status tells why
        log.debug("ssh sync: stdin not fully sent: %r", exc)


class _ChannelStream(io.RawIOBase):
    """A channel's stdout; stderr drained aside; the exit status checked at EOF."""

    def __init__(self, env: SSHEnvironment, chan: paramiko.Channel, script: str) -> None:
        self._env = env
        self._chan = chan
        self._script = script
        self._head = b""
        self._started = False
        self._done = False
        self._stderr: list[bytes] = []
        _workers.submit(self._drain_stderr)

    def _drain_stderr(self) -> None:
        # stdout and stderr share the channel's window: unread stderr would stall stdout.
        try:
            for chunk in iter(lambda: self._chan.recv_stderr(65536), b""):
                self._stderr.append(chunk)
        except Exception as exc:  # noqa: BLE001 - reported through the exit status
            log.debug("ssh sync: stderr lost: %r", exc)

    def readable(self) -> bool:
        return True

    def _recv(self, n: int) -> bytes:
        try:
            return self._chan.recv(n)
        except Exception as exc:
            raise TransportError(f"ssh sync: connection to {self._env.host_label} lost: {exc!r}", transient=True) from exc

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        if n is None or n < 0:
            parts = []
            while chunk := self.read(_CHUNK):
                parts.append(chunk)
            return b"".join(parts)
        while not self._started:
            data = self._recv(_CHUNK)
            if not data:
                self._head, self._started = b"", True
                break
            self._head += data
            i = self._head.find(_GO)
            if i >= 0:
                self._head, self._started = self._head[i + len(_GO) :], True
        if self._head:
            data, self._head = self._head[:n], self._head[n:]
            return data
        data = self._recv(n) if not self._done else b""
        if not data and not self._done:
            self._finish()
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def _finish(self) -> None:
        self._done = True
        chan = self._chan
        chan.status_event.wait()
        sig = getattr(chan, "hermes_signal", None)
        code = -sig if sig else chan.exit_status
        chan.close()
        if code == -1:
            raise TransportError(
                f"ssh sync: the connection to {self._env.host_label} was lost during: {self._script[:200]}",
                transient=True,
            )
        if code != 0:
            raise CommandFailedError(self._script, code, b"".join(self._stderr))

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._chan.close()
        super().close()
