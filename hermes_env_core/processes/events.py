"""Notifications about background processes and their delivery, each exactly once.

Every notification goes once into the registry's completion queue and once to
each callback; callbacks run on one dispatcher thread, so a slow callback
delays other callbacks but never the processes' output or the queue.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Notification", "NotificationCallback", "NotificationKind", "Notifier"]

log = logging.getLogger(__name__)


class NotificationKind(str, enum.Enum):
    MATCH = "match"  # a watched line was printed
    EXIT = "exit"  # the process ended (exit_code; text: its last output)
    WATCH_DISABLED = "watch_disabled"  # over the rate limit for too long
    LOST = "lost"  # found in a checkpoint but no longer ours to follow
    WAITING_FOR_INPUT = "waiting_for_input"  # blocked reading its terminal (text: the prompt)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Notification:
    """What happened to which process.

    ``text``: the matched line (MATCH), the last 2,000 characters of output
    (EXIT), or a sentence for an agent (WATCH_DISABLED, LOST). ``suppressed``:
    matches not reported because of the rate limit (since the previous
    delivered match for MATCH; in total for WATCH_DISABLED).
    """

    kind: NotificationKind
    process_id: str
    seq: int
    time: float
    text: str
    command: str = ""
    exit_code: int | None = None
    status: str | None = None
    pattern: str | None = None
    suppressed: int = 0

    def __str__(self) -> str:
        if self.kind is NotificationKind.MATCH:
            return f"[{self.process_id}] matched {self.pattern!r}: {self.text}"
        if self.kind is NotificationKind.EXIT:
            code = "unknown" if self.exit_code is None else self.exit_code
            return f"[{self.process_id}] {self.status} (exit code {code})"
        if self.kind is NotificationKind.WAITING_FOR_INPUT:
            return f"[{self.process_id}] waiting for input: {self.text}"
        return f"[{self.process_id}] {self.text}"


NotificationCallback = Callable[[Notification], None]

_seq = itertools.count(1)


class Notifier:
    """The completion queue plus callbacks."""

    def __init__(self, callbacks: list[NotificationCallback] | None = None) -> None:
        self.queue: queue.Queue[Notification] = queue.Queue()
        self._callbacks = list(callbacks or ())
        self._work: queue.Queue[tuple[Notification, tuple[NotificationCallback, ...]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def make(self, kind: NotificationKind, process_id: str, text: str, **fields: object) -> Notification:
        return Notification(kind, process_id, next(_seq), time.time(), text, **fields)  # type: ignore[arg-type]

    def emit(self, note: Notification, extra: tuple[NotificationCallback, ...] = ()) -> None:
        self.queue.put(note)
        callbacks = tuple(self._callbacks) + extra
        if callbacks and not self._closed:
            self._ensure_thread()
            self._work.put((note, callbacks))

    def add_callback(self, cb: NotificationCallback) -> None:
        self._callbacks.append(cb)

    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._dispatch, name="hermes-env-notify", daemon=True)
                self._thread.start()

    def _dispatch(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            note, callbacks = item
            for cb in callbacks:
                try:
                    cb(note)
                except Exception:
                    log.exception("hermes-env: notification callback %r failed on %s", cb, note)

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued for callbacks, then stop the dispatcher."""
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._work.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)
