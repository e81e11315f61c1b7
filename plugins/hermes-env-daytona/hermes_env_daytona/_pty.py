"""A byte stream to a program in the sandbox, over one of the daemon's PTY sessions.

The daemon has no "run this program with a pipe for stdin and stdout" call that
stays open; it has PTY sessions: its shell (zsh, bash or sh) started ``-i -l``
on a terminal, reached over a WebSocket. Made to carry raw bytes:

1. the shell gets one short line, in its cooked terminal: unless bash is
   missing, ``stty raw -echo -iexten`` (no echo, no CR/LF translation, no
   character that signals, ends input, erases, escapes or stops the flow),
   then a marker; then it becomes ``setsid -w bash`` (no controlling terminal,
   so no command can open ``/dev/tty`` and read the stream), reading one line;
2. once the marker is seen (the terminal is raw by then) that line goes up:
   the relay below, and ``argv`` behind it; a second marker says every byte
   after it is the program's, both ways.

The relay. bash never reads the terminal with ``read -d``/``-N`` (those turn
cbreak mode on while they read: signals and CR->NL back), so the program's
stdin is a pipe fed by a demultiplexer that reads the terminal with plain
``read`` and ``head -c``: the client sends ``D <n>\n`` and n bytes of data
(``T`` for a short chunk with no NUL, which bash reads itself: no fork), or
``A <total>\n``, how many bytes of output it has received. The program's
stdout is a pipe, copied to the terminal one ``dd`` read at a time, never more
than ``_WINDOW`` bytes ahead of those acknowledgements: the daemon drops a
client that falls 256 messages behind ("slow consumer"), and a fast writer
(50 MB of output) would otherwise outrun any client.

The session is killed (its whole tree) when the stream is closed.
"""

from __future__ import annotations

import queue
import secrets
import shlex
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hermes_env_core.errors import EnvironmentUnavailable

__all__ = ["NoBash", "PtyStream", "open_pty_stream"]

_CHUNK = 32 * 1024  # one WebSocket message; the daemon drops a connection over 64 KiB
_WINDOW = 256 * 1024  # output the sandbox may send ahead of the acknowledgements
_ACK_EVERY = 64 * 1024
_TEXT_MAX = 4096  # bash reads a pipe a byte at a time: beyond this, a fork of head costs less
_BOOT_TIMEOUT_S = 30.0


class NoBash(EnvironmentUnavailable):
    """The sandbox's image has no bash on the PATH."""


def _word(text: str) -> str:
    """``text`` as one shell word on one line (``$'...'`` when it holds control characters)."""
    if all(" " <= c != "\x7f" for c in text):
        return shlex.quote(text)
    out = []
    for c in text:
        if c in "\\'":
            out.append("\\" + c)
        elif c < " " or c == "\x7f":
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "$'" + "".join(out) + "'"


def _frame(chunk: bytes) -> bytes:
    """``T``: read by bash itself (no NUL, few bytes: no fork); ``D``: by ``head -c``."""
    kind = b"T" if len(chunk) <= _TEXT_MAX and b"\0" not in chunk else b"D"
    return b"%s %d\n%s" % (kind, len(chunk), chunk)


class PtyStream:
    """A ``ChannelStream`` over a ``PtyHandle``: ``read`` blocks, ``write`` raises OSError once broken."""

    def __init__(self, handle: Any, kill: Callable[[], None]) -> None:
        self._handle = handle
        self._kill = kill
        self._chunks: queue.Queue[bytes] = queue.Queue()
        self._buf = b""
        self._lock = threading.Lock()
        self._closed = False
        self.framed = False  # the relay runs: writes are framed, reads acknowledged
        self._got = 0
        self._acked = 0
        threading.Thread(target=self._pump, name="hermes-daytona-pty", daemon=True).start()

    def _pump(self) -> None:
        try:
            for data in self._handle:
                if data:
                    self._chunks.put(data)
        except Exception:  # noqa: BLE001, S110 - a broken connection is the end of the stream
            pass
        finally:
            self._chunks.put(b"")

    def _next(self, timeout: float | None) -> bytes:
        if self._buf:
            data, self._buf = self._buf, b""
            return data
        data = self._chunks.get(timeout=timeout)
        if not data:
            self._chunks.put(b"")  # keep saying so
        return data

    def read(self, n: int) -> bytes:
        data = self._next(None)
        if len(data) > n:
            data, self._buf = data[:n], data[n:]
        if self.framed:
            self._got += len(data)
            if self._got - self._acked >= _ACK_EVERY:
                self._acked = self._got
                try:  # one message of its own, never behind a write that waits
                    self._handle.send_input(b"A %d\n" % self._got)
                except Exception:  # noqa: BLE001, S110 - the end of the stream shows on the next read
                    pass
        return data

    def expect(self, marks: Sequence[bytes], deadline: float) -> tuple[bytes, bytes]:
        """Read until one of ``marks``; (the mark, what came before it). Bytes after it stay unread."""
        seen = b""
        while True:
            for mark in marks:
                i = seen.find(mark)
                if i >= 0:
                    self._buf = seen[i + len(mark) :] + self._buf
                    return mark, seen[:i]
            left = deadline - time.monotonic()
            try:
                data = self._next(max(left, 0.0)) if left > 0 else b""
            except queue.Empty:
                data = b""
            if not data:
                raise EnvironmentUnavailable(
                    "daytona: the PTY session ended or stayed silent before the program started: "
                    + repr(seen[-300:].decode(errors="replace"))
                )
            seen += data

    def write(self, data: bytes) -> None:
        if self._closed:
            raise OSError("the PTY stream is closed")
        with self._lock:
            for i in range(0, len(data), _CHUNK):
                chunk = bytes(data[i : i + _CHUNK])
                try:
                    self._handle.send_input(_frame(chunk) if self.framed else chunk)
                except Exception as exc:  # noqa: BLE001 - the SDK's DaytonaError, or a socket error
                    raise OSError(f"the PTY session's connection broke: {exc}") from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._kill()  # the session's whole tree; the daemon keeps a disconnected session running
        except Exception:  # noqa: BLE001, S110 - gone already, or the sandbox is
            pass
        try:
            self._handle.disconnect()
        except Exception:  # noqa: BLE001, S110
            pass


def open_pty_stream(sandbox: Any, argv: Sequence[str], *, pty_size: Any = None) -> PtyStream:
    """Start ``argv`` in ``sandbox`` behind a raw PTY session; the stream to it."""
    token = secrets.token_hex(8)
    sid = f"hermes-{token}"
    handle = sandbox.process.create_pty_session(sid, pty_size=pty_size)
    stream = PtyStream(handle, lambda: sandbox.process.kill_pty_session(sid, request_timeout=10))
    relay = "IFS= read -r __p && eval \"$__p\""
    first = (
        f"command -v bash >/dev/null 2>&1 || {{ printf '\\036%s\\n' {token}:nobash; exit 127; }}; "
        f"stty raw -echo -iexten && printf '\\036%s\\n' {token}:ok && "
        f"{{ exec setsid -w bash -c '{relay}' 2>/dev/null; exec bash -c '{relay}' 2>/dev/null; }}\n"
    )
    program = " ".join(_word(a) for a in argv)
    demux = (
        "while IFS=' ' read -r t n; do case $t in D) head -c \"$n\" || exit;; "
        "T) LC_ALL=C IFS= read -r -N \"$n\" x || exit; printf %s \"$x\";; "
        "A) printf '%s\\n' \"$n\" >&5;; *) exit;; esac; done"
    )
    pacer = (
        "s=0 a=0; while :; do while (( s - a >= " + str(_WINDOW) + " )); do IFS= read -r a <&5 || exit; done; "
        "while read -t 0 -u 5 && IFS= read -r a <&5; do :; done; dd bs=65536 count=1 2>&7 || exit; "
        "IFS= read -r n <&7; IFS= read -r n <&7; IFS=' ' read -r n _ <&7; [[ $n -gt 0 ]] || exit; s=$((s + n)); done"
    )
    second = (
        f"exec 5<> <(:) 7<> <(:); exec 4< <(exec cat); __c=$!; exec 3< <({demux} <&4 4<&-); __d=$!; exec 4<&-; printf '\\036%s\\n' {token}:go; "
        f"{program} <&3 3<&- | {{ {pacer}; }}; __r=${{PIPESTATUS[0]}}; kill \"$__c\" \"$__d\"; exit \"$__r\"\n"
    )
    deadline = time.monotonic() + _BOOT_TIMEOUT_S
    try:
        stream.write(first.encode())
        ok, nobash = f"\x1e{token}:ok\n".encode(), f"\x1e{token}:nobash".encode()
        if stream.expect([ok, nobash], deadline)[0] == nobash:
            raise NoBash("daytona: the sandbox has no bash")
        stream.write(second.encode())
        stream.expect([f"\x1e{token}:go\n".encode()], deadline)
        stream.framed = True
    except BaseException:
        stream.close()
        raise
    return stream
