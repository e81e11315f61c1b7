"""A background process's output: a rolling window of its last bytes, addressed by offset.

Chunks are kept as they arrived (no growing string is rebuilt per chunk) and
joined only when read; offsets count every byte the process ever wrote.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import IO

__all__ = ["DEFAULT_BUFFER_BYTES", "OutputBuffer", "OutputSlice"]

DEFAULT_BUFFER_BYTES = 200 * 1024


@dataclass(frozen=True)
class OutputSlice:
    """Bytes ``[offset, next_offset)`` of a process's output.

    ``dropped`` counts the bytes between the requested offset and ``offset``
    that had already left the rolling buffer. Pass ``next_offset`` as the next
    ``since``; it never splits a UTF-8 character while the process runs.
    """

    data: bytes
    offset: int
    next_offset: int
    dropped: int

    @property
    def text(self) -> str:
        return _trim_start(self.data).decode("utf-8", "replace") if self.dropped else self.data.decode(
            "utf-8", "replace"
        )


class OutputBuffer:
    """Keeps the last ``limit`` bytes; optionally appends everything to ``log``.

    Thread-safe: one writer (the process's follower) and any number of readers,
    who may block in ``wait()`` until output passes an offset.
    """

    def __init__(self, limit: int = DEFAULT_BUFFER_BYTES, *, start: int = 0, log: IO[bytes] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"buffer limit must be at least 1 byte, not {limit}")
        self.limit = limit
        self._chunks: deque[bytes] = deque()
        self._phys_start = start  # offset of the first byte of _chunks[0]
        self._end = start
        self._held = 0  # bytes in _chunks
        self._log = log
        self._closed = False
        self.log_error: str | None = None
        self._cond = threading.Condition(threading.Lock())

    @property
    def end(self) -> int:
        """Offset just past the last byte received."""
        return self._end

    @property
    def start(self) -> int:
        """Oldest offset still readable."""
        return max(self._phys_start, self._end - self.limit)

    @property
    def closed(self) -> bool:
        return self._closed

    def append(self, data: bytes) -> None:
        if not data:
            return
        if self._log is not None:
            try:
                self._log.write(data)
            except (OSError, ValueError) as exc:
                # A full disk ends the log, not the process or its buffer.
                self.log_error = f"log stopped at offset {self._end}: {exc}"
                self.close_log()
        with self._cond:
            self._chunks.append(data)
            self._held += len(data)
            self._end += len(data)
            # Keep whole chunks; the window's edge is applied when reading.
            while self._held - len(self._chunks[0]) >= self.limit:
                first = self._chunks.popleft()
                self._held -= len(first)
                self._phys_start += len(first)
            self._cond.notify_all()

    def skip_to(self, offset: int) -> None:
        """Start an empty buffer at ``offset`` (output before it is not kept)."""
        with self._cond:
            if self._chunks:
                raise RuntimeError("skip_to() on a buffer that holds output")
            self._phys_start = self._end = offset

    def close(self) -> None:
        """No more output will come: wake waiters, flush the log."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._log is not None:
            try:
                self._log.flush()
            except (OSError, ValueError):
                pass

    def close_log(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            try:
                log.close()
            except OSError:
                pass

    def read(self, since: int = 0, max_bytes: int | None = None, *, whole_chars: bool = True) -> OutputSlice:
        """Output from ``since`` (clamped to what is still held) to the end."""
        with self._cond:
            start = self.start
            begin = max(since, start)
            end = self._end
            if max_bytes is not None:
                end = min(end, begin + max_bytes)
            data = self._slice(begin, end) if end > begin else b""
            closed = self._closed
        if whole_chars and not closed and data:
            cut = _incomplete_suffix(data)
            if cut:
                data = data[:-cut]
        return OutputSlice(data, begin, begin + len(data), max(0, begin - since))

    def _slice(self, begin: int, end: int) -> bytes:
        parts: list[bytes] = []
        pos = self._phys_start
        for chunk in self._chunks:
            nxt = pos + len(chunk)
            if nxt > begin:
                lo = max(begin - pos, 0)
                hi = min(end - pos, len(chunk))
                parts.append(chunk[lo:hi] if lo or hi < len(chunk) else chunk)
                if nxt >= end:
                    break
            pos = nxt
        return b"".join(parts)

    def tail_text(self, chars: int) -> str:
        """The last ``chars`` characters held (decoded, invalid bytes replaced)."""
        with self._cond:
            start = max(self.start, self._end - chars * 4)
            data = self._slice(start, self._end) if self._end > start else b""
        text = _trim_start(data).decode("utf-8", "replace") if start > 0 else data.decode("utf-8", "replace")
        return text[-chars:]

    def wait(self, offset: int, timeout: float | None) -> bool:
        """Block until output passes ``offset`` or the buffer closes; True if it passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._end <= offset and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return self._end > offset


def _incomplete_suffix(data: bytes) -> int:
    """Length of a UTF-8 sequence cut off at the end of ``data`` (0 if none)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return 0
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return back if need > back else 0
    return 0


def _trim_start(data: bytes) -> bytes:
    """Drop continuation bytes whose lead byte is not in ``data``."""
    i = 0
    while i < min(3, len(data)) and 0x80 <= data[i] < 0xC0:
        i += 1
    return data[i:]
