"""The sync engine's ``FileSyncTransport`` over an SSH environment's own connection.

``CommandTransport`` decides the commands (tar in, tar out, xargs rm) and
``ParamikoRunner`` runs each on one exec channel; this adds the environment's
reconnecting Transport and keeps the login shell's start-up chatter out of tar streams.
"""

from __future__ import annotations

import io
import shlex
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import EnvironmentUnavailable
from ..sync.paramiko_runner import ParamikoRunner
from ..sync.transport import CommandTransport, TransportError
from .ssh import SSHAuthenticationError, SSHHostKeyError

if TYPE_CHECKING:
    import paramiko

    from .ssh import SSHEnvironment

__all__ = ["SSHCommandRunner", "SSHSyncTransport"]

# A ~/.bashrc that prints would corrupt a tar stream (as it breaks scp): the
# stream starts after this line.
_GO = b"\x1ehermes-sync-go\n"
_GO_CMD = "command printf '\\036hermes-sync-go\\n'; "
_CHUNK = 256 * 1024


class SSHSyncTransport(CommandTransport):
    """``FileSyncTransport`` for an ``SSHEnvironment``: one channel per operation."""

    def __init__(self, env: SSHEnvironment, *, timeout: float | None = 300.0) -> None:
        super().__init__(SSHCommandRunner(env, timeout=timeout), stream_stdin=True)


class SSHCommandRunner:
    """``CommandRunner``: a POSIX sh command on the environment's connection."""

    def __init__(self, env: SSHEnvironment, *, timeout: float | None = 300.0) -> None:
        self._env = env
        self._inner = ParamikoRunner(self._transport, timeout=timeout)

    def _transport(self) -> paramiko.Transport:
        try:
            return self._env._live()
        except (SSHHostKeyError, SSHAuthenticationError) as exc:
            raise TransportError(str(exc), transient=False) from exc
        except EnvironmentUnavailable as exc:
            raise TransportError(f"ssh sync: {exc}", transient=True) from exc

    def __call__(self, script: str, stdin: bytes | BinaryIO | None) -> BinaryIO:
        self._transport()  # connects first, so that the login shell is known
        body = script if self._env._bash_login else f"exec sh -c {shlex.quote(script)}"
        return _AfterMarker(self._inner(_GO_CMD + body, stdin))  # type: ignore[return-value]


class _AfterMarker(io.RawIOBase):
    """``inner`` from just after the ``_GO`` line on."""

    def __init__(self, inner: BinaryIO) -> None:
        self._inner = inner
        self._head = b""
        self._found = False

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            parts = []
            while chunk := self.read(_CHUNK):
                parts.append(chunk)
            return b"".join(parts)
        while not self._found:
            data = self._inner.read(_CHUNK)
            if not data:
                self._found = True  # no marker: the command failed early; EOF says how
                self._head = b""
                break
            self._head += data
            i = self._head.find(_GO)
            if i >= 0:
                self._head, self._found = self._head[i + len(_GO) :], True
        if self._head:
            data, self._head = self._head[:n], self._head[n:]
            return data
        return self._inner.read(n)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            super().close()
