"""Reading a command's output: separating our frame from it, bounding it, decoding it.

Bytes are kept as bytes until the end and decoded once, so a character split
across reads is never mangled; the live ``on_output`` callback decodes
incrementally for the same reason.
"""

from __future__ import annotations

import codecs
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["CapturedOutput", "FrameSplitter", "OutputCapture", "DEFAULT_MAX_OUTPUT_BYTES"]

DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024
_MAX_FRAME_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class CapturedOutput:
    text: str
    truncated: bool
    dropped_bytes: int
    total_bytes: int
    spill_path: str | None


class OutputCapture:
    """Keeps all output up to ``limit`` bytes, past it only the head and the tail."""

    def __init__(
        self,
        limit: int = DEFAULT_MAX_OUTPUT_BYTES,
        *,
        spill_dir: str | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> None:
        self.limit = max(limit, 2)
        self._half = self.limit // 2
        self._buf = bytearray()
        self._head: bytes | None = None
        self._tail: deque[bytes] = deque()
        self._tail_len = 0
        self.total = 0
        self._spill_dir = spill_dir
        self._spill: BinaryIO | None = None
        self.spill_path: str | None = None
        self._on_output = on_output
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace") if on_output else None

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self.total += len(data)
        if self._decoder is not None and self._on_output is not None:
            text = self._decoder.decode(data)
            if text:
                self._on_output(text)
        if self._head is None:
            self._buf += data
            if len(self._buf) > self.limit:
                self._overflow()
            return
        if self._spill is not None:
            self._spill.write(data)
        self._tail.append(data)
        self._tail_len += len(data)
        while self._tail and self._tail_len - len(self._tail[0]) >= self._half:
            self._tail_len -= len(self._tail.popleft())

    def _overflow(self) -> None:
        buf = bytes(self._buf)
        self._buf = bytearray()
        self._head = buf[: self._half]
        rest = buf[self._half :]
        self._tail.append(rest)
        self._tail_len = len(rest)
        if self._spill_dir is not None:
            os.makedirs(self._spill_dir, exist_ok=True)
            fd, self.spill_path = tempfile.mkstemp(
                prefix=time.strftime("hermes-output-%Y%m%d-%H%M%S-"), suffix=".log", dir=self._spill_dir
            )
            self._spill = os.fdopen(fd, "wb")
            self._spill.write(buf)

    def finish(self) -> CapturedOutput:
        if self._decoder is not None and self._on_output is not None:
            text = self._decoder.decode(b"", final=True)
            if text:
                self._on_output(text)
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        if self._head is None:
            data = self._buf
            self._buf = bytearray()
            return CapturedOutput(data.decode("utf-8", "replace"), False, 0, self.total, None)
        tail = b"".join(self._tail)
        if len(tail) > self._half:
            tail = tail[len(tail) - self._half :]
        head = _trim_end(self._head)
        tail = _trim_start(tail)
        dropped = self.total - len(head) - len(tail)
        where = f"; full output in {self.spill_path}" if self.spill_path else ""
        notice = f"\n[hermes-env: output truncated, {dropped} bytes omitted{where}]\n"
        text = head.decode("utf-8", "replace") + notice + tail.decode("utf-8", "replace")
        return CapturedOutput(text, True, dropped, self.total, self.spill_path)


def _trim_end(data: bytes) -> bytes:
    """Drop a UTF-8 sequence cut off at the end."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return data
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return data if need <= back else data[:-back]
    return data


def _trim_start(data: bytes) -> bytes:
    """Drop continuation bytes whose lead byte was cut off."""
    i = 0
    while i < min(3, len(data)) and 0x80 <= data[i] < 0xC0:
        i += 1
    return data[i:]


class FrameSplitter:
    """Routes a byte stream to ``sink`` while lifting out the wrapper's frame.

    The frame is ``MARK S<rc> <cwdlen> <statelen> <enc>\\x1f <cwd><state> MARK E\\n``
    (``enc`` 1: newlines in the state were sent as 0x1f; 2: the state is in
    the state file, which the reader can open itself)
    where MARK holds a per-command nonce, so command output cannot forge it.
    Lengths are checked, so output interleaved into the frame by a background
    writer is detected instead of being restored as shell code.
    """

    def __init__(self, marker: bytes, sink: Callable[[bytes], None]) -> None:
        self._marker = marker
        self._end = marker + b"E\n"
        self._sink = sink
        self._carry = b""
        self._mode = 0  # 0 output, 1 header, 2 body, 3 after frame
        self._frame = bytearray()
        self._header: tuple[int, int, int] | None = None
        self._encoded = 0
        self.frame: tuple[int, str, str | None] | None = None
        self.corrupt = False

    @property
    def done(self) -> bool:
        return self._mode == 3

    def feed(self, chunk: bytes) -> None:
        if self._mode == 3:
            self._sink(chunk)
            return
        if self._mode == 0:
            data = self._carry + chunk if self._carry else chunk
            self._carry = b""
            idx = data.find(self._marker)
            if idx < 0:
                keep = _partial_suffix(data, self._marker)
                if keep:
                    self._sink(data[:-keep])
                    self._carry = data[-keep:]
                else:
                    self._sink(data)
                return
            if idx:
                self._sink(data[:idx])
            self._mode = 1
            chunk = data[idx + len(self._marker) :]
        self._frame += chunk
        if self._mode == 1:
            nl = self._frame.find(b"\x1f")
            if nl < 0:
                if len(self._frame) > 64:
                    self._give_up()
                return
            try:
                kind, rest = self._frame[:1], self._frame[1:nl].decode("ascii")
                rc, cwdlen, statelen, self._encoded = (int(x) for x in rest.split(" "))
                if kind != b"S":
                    raise ValueError(kind)
            except ValueError:
                self._give_up()
                return
            self._header = (rc, cwdlen, statelen)
            del self._frame[: nl + 1]
            self._mode = 2
        self._scan_body()

    def _scan_body(self) -> None:
        assert self._header is not None
        rc, cwdlen, statelen = self._header
        need = cwdlen + statelen
        if len(self._frame) < need + len(self._end):
            if len(self._frame) > _MAX_FRAME_BYTES:
                self._give_up()
            return
        if self._frame[need : need + len(self._end)] == self._end:
            body = bytes(self._frame[:need])
            rest = bytes(self._frame[need + len(self._end) :])
            state: str | None = body[cwdlen:].decode("utf-8", "surrogateescape")
            if self._encoded in (2, 3):
                state = None  # 3: no state (the command never ran)
            elif self._encoded:
                state = state.replace("\x1f", "\n")  # type: ignore[union-attr]
            self.frame = (rc, body[:cwdlen].decode("utf-8", "surrogateescape"), state)
        else:
            pos = self._frame.find(self._end)
            if pos < 0:
                if len(self._frame) > _MAX_FRAME_BYTES:
                    self._give_up()
                return
            self.corrupt = True
            rest = bytes(self._frame[pos + len(self._end) :])
        self._frame = bytearray()
        self._mode = 3
        if rest:
            self._sink(rest)

    def _give_up(self) -> None:
        # The frame is ours, never the command's output: drop it (the caller
        # reports that the state was not saved) rather than leak it.
        self.corrupt = True
        self._frame = bytearray()
        self._mode = 3

    def flush(self) -> None:
        """End of stream: release bytes held back as a possible marker prefix."""
        if self._carry:
            self._sink(self._carry)
            self._carry = b""
        if self._mode in (1, 2):
            self.corrupt = True
            self._frame = bytearray()
            self._mode = 3


def _partial_suffix(data: bytes, marker: bytes) -> int:
    """Length of the longest suffix of ``data`` that is a proper prefix of ``marker``."""
    start = data.rfind(marker[:1], max(0, len(data) - len(marker) + 1))
    while start >= 0:
        if marker.startswith(data[start:]):
            return len(data) - start
        start = data.find(marker[:1], start + 1)
    return 0
