"""SIGTERM, SIGHUP and SIGINT sent to the ``hermes-env`` command end the running command's tree, then the CLI.

A signal becomes the running command's cancel (its whole tree is stopped by
``execute()``), the environment is closed (cgroups, containers), and the
process exits with 128 + the signal's number, as ``docker run``'s proxy does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["SIGNALS", "SignalExit", "SignalGuard", "current_guard"]

#: What a supervisor, ``timeout``, a CI runner or a closed terminal sends.
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class SignalExit(BaseException):
    """The CLI was told to stop by ``signum``; a BaseException so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def status(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


_current: SignalGuard | None = None
_NUDGE_AFTER_S = 0.2  # how long a signal may wait for its handler before it is sent again
_NUDGES = 5


def current_guard() -> SignalGuard | None:
    """The guard installed by the running ``hermes-env`` command, if any."""
    return _current


class SignalGuard:
    """Turns the signals into a cancel while a command runs, and into ``SignalExit`` elsewhere.

    While a command runs (``running``) the signal only sets its cancel event:
    ``execute()`` stops the command's tree and returns, then ``check()`` raises.
    While the environment is being made or closed (``deferred``) the signal is
    only recorded, so that nothing is left half made; ``check()`` raises it
    afterwards. Anywhere else the handler raises ``SignalExit`` at once, which
    unwinds through the ``with`` that closes the environment.

    ``keyboard_interrupt``: SIGINT is a person's Ctrl-C at an interactive
    prompt: it cancels the running command only, and elsewhere raises
    ``KeyboardInterrupt`` (the prompt discards the line), as bash does.
    """

    def __init__(self, *, keyboard_interrupt: bool = False) -> None:
        self.keyboard_interrupt = keyboard_interrupt
        self.received: int | None = None
        self._cancel: threading.Event | None = None
        self._deferring = 0
        self._previous: dict[int, Any] = {}
        self._raised = False
        self._handled = 0  # how many times _handle ran: the watcher's sign that a signal was seen
        self._nudged: dict[int, int] = {}
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1

    # -- installing -------------------------------------------------------------------
    def install(self) -> bool:
        """Install the handlers (main thread only); False when they cannot be installed here."""
        global _current
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        _current = self
        self._start_watcher()
        return True

    def uninstall(self) -> None:
        global _current
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if _current is self:
            _current = None
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._wakeup[1])  # the watcher reads end of file and ends
            self._wakeup = None

    # -- the watcher ------------------------------------------------------------------
    def _start_watcher(self) -> None:
        """Make sure a signal is handled even when the main thread sits in a C loop that missed it.

        Python runs a handler only when the main thread looks; readline's prompt
        loop looks only when its select() is interrupted, so a signal landing
        between two of its selects would wait for the next key. The watcher sees
        every signal on the wakeup fd and, if no handler ran soon after, sends it
        to the main thread again (interrupting the select); a handler that runs
        twice is harmless (see _handle).
        """
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(r)
            os.close(w)
            return
        self._wakeup = (r, w)
        main = threading.main_thread().ident
        threading.Thread(target=self._watch, args=(r, main), name="hermes-env-signals", daemon=True).start()

    def _watch(self, r: int, main: int | None) -> None:
        stops = {int(s) for s in SIGNALS if not (self.keyboard_interrupt and s == signal.SIGINT)}
        try:
            while True:
                seen = self._handled
                data = os.read(r, 512)
                if not data:
                    return
                for signum in set(data) & stops:
                    ours = data.count(signum)
                    skip = min(self._nudged.get(signum, 0), ours)
                    self._nudged[signum] = self._nudged.get(signum, 0) - skip
                    if ours > skip:
                        self._nudge(signum, main, seen)
        finally:
            os.close(r)

    def _nudge(self, signum: int, main: int | None, seen: int) -> None:
        for _ in range(_NUDGES):
            deadline = time.monotonic() + _NUDGE_AFTER_S
            while self._handled == seen and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._handled != seen or main is None or signal.getsignal(signum) != self._handle:
                return  # handled, or another handler (a terminal's) is in charge meanwhile
            self._nudged[signum] = self._nudged.get(signum, 0) + 1
            signal.pthread_kill(main, signum)

    def __enter__(self) -> SignalGuard:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- regions ----------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, cancel: threading.Event) -> Iterator[None]:
        """A command runs: a signal sets ``cancel`` (at once if one came just before)."""
        self._cancel = cancel
        if self.received is not None:
            cancel.set()
        try:
            yield
        finally:
            self._cancel = None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Making or closing the environment: a signal waits for ``check()``."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1

    def check(self) -> None:
        """Raise ``SignalExit`` if a signal came (outside any ``deferred`` region)."""
        if self.received is not None and not self._deferring:
            self._raised = True
            raise SignalExit(self.received)

    # -- the handler ------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._handled += 1
        keyboard = self.keyboard_interrupt and signum == signal.SIGINT
        if self._cancel is not None:
            if not keyboard and self.received is None:
                self.received = signum
            self._cancel.set()
            return
        if self._deferring:
            if self.received is None:
                self.received = signum
            return
        if keyboard:
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum
        if self._raised:
            return  # already on its way out (a second signal, or the watcher's nudge)
        self._raised = True
        raise SignalExit(self.received)
