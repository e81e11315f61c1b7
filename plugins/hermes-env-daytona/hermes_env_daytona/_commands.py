"""The command lines sent to ``process.exec``, and reading a command's output while it runs.

The daemon returns a command's output once every holder of its stdout has
closed it, so a background child (``sleep 300 &``) would hold the call open.
The wrapped script therefore writes into a ``sed`` relay that stops at the
wrapper's end-of-frame line: background children hold only the pipe into
sed, never the daemon's.
"""

from __future__ import annotations

import base64
import re
import shlex
import threading
from collections.abc import Callable

from hermes_env_core.environment.handles import Writer

__all__ = ["ARG_LIMIT", "LiveReader", "bash_line", "file_script", "live_prefix", "nonce_of", "relay_prefix"]

#: A command line is one argv string for the sandbox's shell: Linux caps those at 128 KiB.
ARG_LIMIT = 100_000

_NONCE_RE = re.compile(r"__hermes_n=([0-9a-f]{8,64});")
_CHUNK = 4 * 1024 * 1024


def nonce_of(script: str) -> str | None:
    """The per-command nonce the session wrapper put in ``script`` (it marks the frame)."""
    m = _NONCE_RE.search(script, 0, 16384)
    return m.group(1) if m else None


def relay_prefix(nonce: str | None) -> str:
    """Script text (no newline) that sends bash's output through the relay.

    The relay ignores SIGTERM, so a graceful stop of the command's process
    tree leaves it to pass on what the command printed; it ends at the frame
    or when the last writer is gone. Without a nonce (a wrapper this code
    does not know) the output goes to the daemon directly.
    """
    if nonce is None:
        return "exec 2>&1 </dev/null; "
    stop = shlex.quote(f"/\x1e{nonce}:E$/q")
    return f"exec > >(trap '' TERM; LC_ALL=C exec sed -e {stop}) 2>&1 </dev/null; "


def live_prefix(out_path: str) -> str:
    """Script text that sends bash's output to a file a ``LiveReader`` follows."""
    return f"exec >{shlex.quote(out_path)} 2>&1 </dev/null; "


def bash_line(script: str, *, login: bool) -> str:
    """The command line that runs ``script`` in bash, whatever shell the daemon uses.

    The daemon starts zsh, bash or sh (the first its image lists) and writes
    the command line to that shell's stdin. The script must never be that
    input itself: its first line moves stdin (``exec ... </dev/null``), and a
    shell reading its commands from stdin stops there. So the daemon's shell
    only reads this one line and becomes bash, which gets the script as an
    argument.
    """
    return f"exec bash{' -l' if login else ''} -c {shlex.quote(script)}"


def file_script(script: str) -> bytes:
    """``script`` as a file for ``bash FILE``, which deletes itself as it starts."""
    return ('{ command rm -f -- "$0"; } 2>/dev/null; ' + script).encode("utf-8", "surrogateescape")


def _partial_suffix(data: bytes, marker: bytes) -> int:
    """Length of the longest proper prefix of ``marker`` that ``data`` ends with."""
    for k in range(min(len(marker) - 1, len(data)), 0, -1):
        if data.endswith(marker[:k]):
            return k
    return 0


class LiveReader:
    """Follows a command's output file in the sandbox and writes what appears.

    ``run(script)`` runs a short bash command in the sandbox and returns its
    output. Bytes travel base64-encoded, so they arrive exactly as written.
    Nothing after the wrapper's end-of-frame line is passed on.
    """

    def __init__(self, run: Callable[[str], str], path: str, end: bytes | None, write: Writer) -> None:
        self._run = run
        self.path = path
        self._end = end
        self._write = write
        self.offset = 0
        self._carry = b""
        self.ended = False

    def read_once(self, limit: int = _CHUNK) -> int:
        q = shlex.quote(self.path)
        out = self._run(f"tail -c +{self.offset + 1} -- {q} 2>/dev/null | head -c {int(limit)} | base64")
        data = base64.b64decode(out.encode("ascii", "ignore"))
        self.offset += len(data)
        self._emit(data)
        return len(data)

    def _emit(self, data: bytes) -> None:
        if self.ended or not data:
            return
        buf = self._carry + data if self._carry else data
        self._carry = b""
        if self._end is None:
            self._write(buf)
            return
        idx = buf.find(self._end)
        if idx >= 0:
            self._write(buf[: idx + len(self._end)])
            self.ended = True
            return
        keep = _partial_suffix(buf, self._end)
        if keep:
            self._carry = buf[-keep:]
            buf = buf[:-keep]
        if buf:
            self._write(buf)

    def follow(self, stop: threading.Event, *, first: float = 0.05, longest: float = 0.5) -> None:
        """Poll until ``stop`` is set; a failed poll is retried at the next one."""
        delay = first
        while not stop.wait(delay):
            try:
                got = self.read_once()
            except Exception:  # noqa: BLE001 - transient; the final read reports for real
                got = 0
            delay = first if got else min(delay * 2, longest)

    def finish(self) -> None:
        """Read what is left, then remove the file."""
        while not self.ended and self.read_once() >= _CHUNK:
            pass
        if self._carry and not self.ended:
            self._write(self._carry)
            self._carry = b""
        self._run(f"rm -f -- {shlex.quote(self.path)}")
