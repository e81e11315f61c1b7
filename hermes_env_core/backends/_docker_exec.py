"""One Docker exec as a process handle: the attach stream demultiplexed into a pipe.

Exit is taken from ``exec_inspect``, not from the end of the stream, because a
background grandchild keeps the stream open for up to two seconds after bash exits.
"""

from __future__ import annotations

import io
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from ..errors import BackendError

__all__ = ["MARKER_VAR", "ExecHandle", "ExecStream"]

#: Exec environment variable naming the command, so its bash can be found
#: in the container's /proc; the ``__hermes_`` prefix keeps it out of the
#: session state.
MARKER_VAR = "__hermes_exec"

_INLINE_STDIN = 16384  # written from the caller's thread; more goes through a thread
_FIRST_WAIT_S = 0.01  # the stream usually ends this soon after bash exits
_INSPECT_EVERY_S = 0.005  # exit polling once bash should be gone (wait)
_POLL_EVERY_S = (0.1, 0.5)  # exit polling while output is quiet (poll): first 2 s, later


def open_stream(api: Any, exec_id: str) -> tuple[io.BufferedReader, socket.socket | None, Any]:
    """Start the exec and return (reader, socket, response).

    The reader is the buffered file the HTTP headers were parsed from: bytes
    that arrived with the headers are in its buffer, so it is read, not the
    raw socket.
    """
    resp = api._post_json(
        api._url("/exec/{0}/start", exec_id),
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        data={"Tty": False, "Detach": False},
        stream=True,
    )
    api._raise_for_status(resp)
    reader = resp.raw._fp.fp
    raw = getattr(reader, "raw", None)
    sock = getattr(raw, "_sock", None)
    if isinstance(sock, socket.socket):
        sock.settimeout(None)  # a quiet command may run for hours
    else:
        sock = None
    return reader, sock, resp


class ExecStream:
    """An exec's attach socket as a resident channel's stream: stdin written
    raw, stdout read demultiplexed (stderr dropped).

    ``conn`` is what the SDK's public ``exec_start(..., socket=True)`` returns:
    a socket, or a read-only socket file whose descriptor we duplicate to
    write. Nothing is read before we write, so no byte waits in the SDK's
    HTTP buffer.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        if hasattr(conn, "sendall") and hasattr(conn, "recv"):
            self._sock = conn
        else:
            self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._sock.settimeout(None)
        self._kind = 0
        self._left = 0
        self._closed = False

    def _recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self._sock.recv(n - len(out))
            if not chunk:
                return b""
            out += chunk
        return out

    def read(self, n: int) -> bytes:
        try:
            while True:
                if self._left:
                    data: bytes = self._sock.recv(min(n, self._left))
                    if not data:
                        return b""
                    self._left -= len(data)
                    if self._kind == 1:
                        return data
                    continue
                head = self._recv_exact(8)
                if not head:
                    return b""
                self._kind, self._left = head[0], int.from_bytes(head[4:8], "big")
        except OSError:
            return b""

    def write(self, data: bytes) -> None:
        self._sock.sendall(data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for obj in (self._sock, self._conn):
            try:
                if obj is self._sock:
                    obj.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - already gone
                pass


class ExecHandle:
    """A started exec; satisfies ``ProcessHandle``.

    ``on_exit(handle, code)`` runs once when the exit code is known, before
    ``wait`` returns it; it may raise ``BackendError`` (the container died).
    ``killer(graceful)`` ends the command's process tree in the container.
    """

    def __init__(
        self,
        api: Any,
        exec_id: str,
        *,
        stdin_data: bytes | None,
        killer: Callable[[bool], None] | None = None,
        on_exit: Callable[[ExecHandle, int], None] | None = None,
    ) -> None:
        self._api = api
        self.exec_id = exec_id
        self._killer = killer
        self._on_exit = on_exit
        self.returncode: int | None = None
        self.error: BaseException | None = None
        self.killed = False
        self.started = time.time()
        self._exit: int | None = None  # seen by exec_inspect, stream maybe still open
        self._last_inspect = 0.0
        self._stopping = False
        self._eof = threading.Event()
        self._reader, self._sock, self._resp = open_stream(api, exec_id)
        r, w = os.pipe()
        self.stdout: IO[bytes] | None = os.fdopen(r, "rb", buffering=0)
        self._w = w
        self._thread = threading.Thread(target=self._pump, name="hermes-docker-exec", daemon=True)
        self._thread.start()
        if stdin_data is not None:
            if len(stdin_data) <= _INLINE_STDIN:
                self._feed(stdin_data)
            else:
                threading.Thread(target=self._feed, args=(stdin_data,), name="hermes-docker-stdin", daemon=True).start()

    # -- the stream ---------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendall(data)
            self._sock.shutdown(socket.SHUT_WR)  # EOF on the command's stdin
        except OSError:
            pass  # the command exited without reading it all

    def _pump(self) -> None:
        """Split the multiplexed stream (8-byte headers) into the pipe."""
        buf = b""
        write = self._write
        try:
            while True:
                chunk = self._reader.read1(65536)
                if not chunk:
                    break
                buf = buf + chunk if buf else chunk
                pos, end = 0, len(buf)
                while end - pos >= 8:
                    size = int.from_bytes(buf[pos + 4 : pos + 8], "big")
                    if end - pos - 8 < size:
                        break
                    if buf[pos] in (1, 2) and size:  # stdout, stderr
                        if not write(memoryview(buf)[pos + 8 : pos + 8 + size]):
                            return
                    pos += 8 + size
                buf = buf[pos:]
        except (OSError, ValueError, AttributeError) as exc:
            if not self._stopping:
                self.error = exc
        finally:
            self._close_write()
            self._close_stream()
            self._eof.set()

    def _write(self, view: memoryview) -> bool:
        while view:
            try:
                n = os.write(self._w, view)
            except OSError:
                return False  # the reader closed its end: drop the rest
            view = view[n:]
        return True

    def _close_write(self) -> None:
        w, self._w = self._w, -1
        if w >= 0:
            os.close(w)

    def _close_stream(self) -> None:
        for closer in (getattr(self._resp, "close", None), getattr(self._sock, "close", None)):
            try:
                if closer is not None:
                    closer()
            except Exception:  # noqa: BLE001 - already torn down
                pass

    def _stop_reading(self) -> None:
        """bash has exited but a grandchild holds the stream: let it go."""
        self._stopping = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(0.2)  # it may be blocked writing to a pipe nobody reads yet

    def read_until(self, token: bytes, timeout: float) -> bytes:
        """Output up to ``token`` (or the end, or ``timeout``), for helper execs."""
        assert self.stdout is not None
        fd, out = self.stdout.fileno(), b""
        deadline = time.monotonic() + timeout
        while token not in out:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
        return out

    def abandon(self) -> None:
        """Stop caring about this exec; it finishes on its own."""
        self.killed = True
        self._stop_reading()
        if self.stdout is not None:
            self.stdout.close()

    # -- exit ---------------------------------------------------------------
    def _inspect(self) -> int | None:
        info = self._api.exec_inspect(self.exec_id)
        if info.get("Running") or info.get("ExitCode") is None:
            return None  # running, or not started yet
        return int(info["ExitCode"])

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._exit is None and not self._eof.is_set():
            now = time.monotonic()
            every = _POLL_EVERY_S[0] if time.time() - self.started < 2.0 else _POLL_EVERY_S[1]
            if now - self._last_inspect < every:
                return None
            self._last_inspect = now
            try:
                self._exit = self._inspect()
            except Exception:  # noqa: BLE001 - reported by wait()
                return None
        if self._exit is not None:
            return self._exit
        return self._finish() if self._eof.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._exit is None and not self._eof.wait(_FIRST_WAIT_S):
            while True:
                try:
                    self._exit = self._inspect()
                except Exception as exc:
                    raise BackendError(f"docker: lost the exec: {exc}") from exc
                if self._exit is not None or self._eof.wait(_INSPECT_EVERY_S):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError("command still running")
        if self._exit is not None and not self._eof.is_set():
            self._stop_reading()
        return self._finish()

    def _finish(self) -> int:
        code = self._exit
        if code is None:  # the stream ended: the exit code is (nearly) there
            try:
                for _ in range(200):
                    code = self._inspect()
                    if code is not None:
                        break
                    time.sleep(_INSPECT_EVERY_S)
            except Exception as exc:
                raise BackendError(f"docker: lost the exec: {exc}") from exc
        if self.error is not None and not self.killed:
            raise BackendError(f"docker: the exec stream failed: {self.error!r}") from self.error
        code = -1 if code is None else code
        if self._on_exit is not None:
            hook, self._on_exit = self._on_exit, None
            hook(self, code)
        self.returncode = code
        return code

    # -- stopping -------------------------------------------------------------
    def terminate(self) -> None:
        self.killed = True
        if self._killer is not None:
            self._killer(True)

    def kill(self) -> None:
        self.killed = True
        if self._killer is not None:
            self._killer(False)
