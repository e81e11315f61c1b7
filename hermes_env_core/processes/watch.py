"""Watch patterns: which output lines an agent wants to hear about, and how often.

Lines are matched whole, however the output was cut into reads; a line that
arrives in pieces is matched once, when its newline arrives (or at exit).
"""

from __future__ import annotations

import codecs
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Union

__all__ = ["DEFAULT_RATE_LIMIT", "LineMatcher", "RateLimit", "RateLimiter", "WatchPattern", "WatchSpec", "parse_watch"]

MAX_LINE_CHARS = 65536  # a longer line is matched in pieces of this size


@dataclass(frozen=True)
class WatchPattern:
    """A substring (default) or a regular expression, matched against each line.

    Regexes are compiled with ``re.MULTILINE``: ``^`` and ``$`` anchor at the
    line's ends.
    """

    pattern: str
    regex: bool = False
    ignore_case: bool = False

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ValueError("a watch pattern may not be empty")
        if self.regex:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"watch pattern {self.pattern!r} is not a valid regex: {exc}") from exc

    def to_record(self) -> dict[str, object]:
        return {"pattern": self.pattern, "regex": self.regex, "ignore_case": self.ignore_case}

    @classmethod
    def from_record(cls, rec: dict[str, object]) -> WatchPattern:
        return cls(str(rec["pattern"]), bool(rec.get("regex")), bool(rec.get("ignore_case")))

    def __str__(self) -> str:
        return f"/{self.pattern}/" if self.regex else self.pattern


WatchSpec = Union[str, "re.Pattern[str]", WatchPattern, Iterable[Union[str, "re.Pattern[str]", WatchPattern]], None]


def parse_watch(watch: WatchSpec) -> tuple[WatchPattern, ...]:
    """Normalise what ``spawn(watch=...)`` accepts: str (substring), compiled regex, WatchPattern, or a list."""
    if watch is None:
        return ()
    if isinstance(watch, (str, re.Pattern, WatchPattern)):
        items: Iterable[object] = (watch,)
    else:
        items = watch
    out: list[WatchPattern] = []
    for item in items:
        if isinstance(item, WatchPattern):
            out.append(item)
        elif isinstance(item, re.Pattern):
            out.append(WatchPattern(item.pattern, regex=True, ignore_case=bool(item.flags & re.IGNORECASE)))
        elif isinstance(item, str):
            out.append(WatchPattern(item))
        else:
            raise TypeError(f"a watch pattern is a str, a compiled regex or a WatchPattern, not {type(item).__name__}")
    return tuple(out)


def _finder(p: WatchPattern) -> Callable[[str, int], int]:
    """Where the next candidate match at or after ``pos`` starts (-1: none)."""
    if not p.regex and not p.ignore_case:
        needle = p.pattern

        def find(text: str, pos: int) -> int:
            return text.find(needle, pos)

        return find
    rx = re.compile(p.pattern if p.regex else re.escape(p.pattern), re.MULTILINE | (re.IGNORECASE if p.ignore_case else 0))

    def search(text: str, pos: int) -> int:
        m = rx.search(text, pos)
        return -1 if m is None else m.start()

    return search


def _line_test(p: WatchPattern) -> Callable[[str], bool]:
    if not p.regex and not p.ignore_case:
        needle = p.pattern
        return lambda line: needle in line
    rx = re.compile(p.pattern if p.regex else re.escape(p.pattern), re.MULTILINE | (re.IGNORECASE if p.ignore_case else 0))
    return lambda line: rx.search(line) is not None


class LineMatcher:
    """Feeds on raw output bytes and returns ``(pattern, line)`` for each matching line.

    The whole run of complete lines in a read is searched at once (one
    ``find`` or regex scan per pattern), so cost grows with matches, not with
    lines. Plain substrings are searched in the bytes themselves (UTF-8 is
    self-synchronising, so a byte match is a character match) and only a
    matching line is decoded; regexes and case-insensitive patterns search
    decoded text. A line matching several patterns is reported once, for the
    first of them.
    """

    def __init__(self, patterns: Iterable[WatchPattern], *, max_line: int = MAX_LINE_CHARS) -> None:
        self.patterns = tuple(patterns)
        self._max_line = max_line
        self._bytes = all(not p.regex and not p.ignore_case for p in self.patterns)
        self._needles = [(p, p.pattern.encode("utf-8")) for p in self.patterns]
        self._find = [(p, _finder(p), _line_test(p)) for p in self.patterns]
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._carry = ""  # text mode: the line in progress
        self._bcarry = b""  # bytes mode: the line in progress

    def partial(self) -> bytes:
        """The line in progress (to hand to a matcher that replaces this one)."""
        return self._bcarry if self._bytes else self._carry.encode("utf-8")

    def feed(self, data: bytes) -> list[tuple[WatchPattern, str]]:
        return self._feed_bytes(data) if self._bytes else self._feed_text(data)

    def flush(self) -> list[tuple[WatchPattern, str]]:
        """End of output: the last line, if it had no newline."""
        if self._bytes:
            rest, self._bcarry = self._bcarry, b""
            return self._scan_bytes(rest, 0, len(rest)) if rest else []
        text = self._carry + self._decoder.decode(b"", final=True)
        self._carry = ""
        return self._scan(text) if text else []

    # -- bytes: plain substrings ------------------------------------------------------
    def _feed_bytes(self, data: bytes) -> list[tuple[WatchPattern, str]]:
        last = data.rfind(b"\n")
        if last < 0:
            self._bcarry += data
            if len(self._bcarry) > self._max_line:
                rest, self._bcarry = self._bcarry, b""
                return self._scan_bytes(rest, 0, len(rest))
            return []
        hits: list[tuple[WatchPattern, str]] = []
        first = data.find(b"\n")
        # The line in progress ends in this read: join only it, not the read.
        head = self._bcarry + data[: first + 1] if self._bcarry else None
        if head is not None:
            hits += self._scan_bytes(head, 0, len(head))
            begin = first + 1
        else:
            begin = 0
        if last + 1 > begin:
            hits += self._scan_bytes(data, begin, last + 1)
        self._bcarry = data[last + 1 :]
        if len(self._bcarry) > self._max_line:
            rest, self._bcarry = self._bcarry, b""
            hits += self._scan_bytes(rest, 0, len(rest))
        return hits

    def _scan_bytes(self, buf: bytes, begin: int, end: int) -> list[tuple[WatchPattern, str]]:
        found: dict[int, tuple[WatchPattern, str]] = {}
        for p, needle in self._needles:
            pos = begin
            while pos < end:
                at = buf.find(needle, pos, end)
                if at < 0:
                    break
                start = buf.rfind(b"\n", begin, at) + 1 or begin
                stop = buf.find(b"\n", at, end)
                if stop < 0:
                    stop = end
                if start not in found:
                    line = buf[start:stop].decode("utf-8", "replace").removesuffix("\r")
                    found[start] = (p, line)
                pos = stop + 1
        return [found[k] for k in sorted(found)]

    # -- text: regexes, case-insensitive ------------------------------------------------
    def _feed_text(self, data: bytes) -> list[tuple[WatchPattern, str]]:
        text = self._decoder.decode(data)
        if not text:
            return []
        if self._carry:
            text = self._carry + text
        cut = text.rfind("\n")
        if cut < 0:
            if len(text) > self._max_line:
                self._carry = ""
                return self._scan(text)
            self._carry = text
            return []
        self._carry = text[cut + 1 :]
        hits = self._scan(text[: cut + 1])
        if len(self._carry) > self._max_line:
            hits += self._scan(self._carry)
            self._carry = ""
        return hits

    def _scan(self, text: str) -> list[tuple[WatchPattern, str]]:
        if "\r\n" in text:
            text = text.replace("\r\n", "\n")  # a terminal's line ends, so that $ anchors before them
        found: dict[int, tuple[WatchPattern, str]] = {}
        n = len(text)
        for p, find, test in self._find:
            pos = 0
            while pos < n:
                at = find(text, pos)
                if at < 0:
                    break
                start = text.rfind("\n", 0, at) + 1
                end = text.find("\n", at)
                if end < 0:
                    end = n
                if start not in found:
                    line = text[start:end].removesuffix("\r")
                    # A regex scan of many lines may match across a newline;
                    # only a match within the line counts.
                    if test(line):
                        found[start] = (p, line)
                pos = end + 1
        return [found[k] for k in sorted(found)]


@dataclass(frozen=True)
class RateLimit:
    """At most ``max_matches`` notifications per ``window_s``; a process over the
    limit in every window for ``disable_after_s`` has its watch disabled."""

    max_matches: int = 8
    window_s: float = 10.0
    disable_after_s: float = 45.0

    def __post_init__(self) -> None:
        if self.max_matches < 1 or self.window_s <= 0 or self.disable_after_s < 0:
            raise ValueError(f"invalid rate limit {self!r}")


DEFAULT_RATE_LIMIT = RateLimit()

Verdict = Literal["deliver", "suppress", "disable"]


class RateLimiter:
    """Fixed windows from the first match. Over the limit = a match was
    suppressed in the window; the run of such windows must be unbroken
    (a window at or under the limit, or one with no match at all, resets it)."""

    def __init__(self, limit: RateLimit = DEFAULT_RATE_LIMIT, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self._origin: float | None = None
        self._window = -1
        self._count = 0
        self._over_since: float | None = None
        self.delivered = 0
        self.suppressed = 0  # in total
        self.suppressed_in_run = 0  # since the current run over the limit began
        self._pending = 0  # suppressed since the last delivered match

    def check(self, now: float | None = None) -> Verdict:
        if now is None:
            now = self._clock()
        lim = self.limit
        if self._origin is None:
            self._origin = now
        window = int((now - self._origin) // lim.window_s)
        if window != self._window:
            was_over = self._count > lim.max_matches
            if not (was_over and window == self._window + 1):
                self._over_since = None
                self.suppressed_in_run = 0
            self._window = window
            self._count = 0
        self._count += 1
        if self._count <= lim.max_matches:
            self.delivered += 1
            return "deliver"
        self.suppressed += 1
        self.suppressed_in_run += 1
        self._pending += 1
        if self._over_since is None:
            self._over_since = now
        elif now - self._over_since >= lim.disable_after_s:
            return "disable"
        return "suppress"

    def take_pending(self) -> int:
        """Matches suppressed since the last delivered one (and reset the count)."""
        n, self._pending = self._pending, 0
        return n
