"""SIGTERM, SIGHUP and SIGINT sent to the ``hermes-env`` command end the running command's tree, then the CLI.

A signal becomes the running command's cancel (its whole tree is stopped by
``execute()``), the environment is closed (cgroups, containers), and the
process exits with 128 + the signal's number, as ``docker run``'s proxy does.
"""

from __future__ import annotations

import contextlib
import signal
import threading
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

    # -- installing -------------------------------------------------------------------
    def install(self) -> bool:
        """Install the handlers (main thread only); False when they cannot be installed here."""
        global _current
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        _current = self
        return True

    def uninstall(self) -> None:
        global _current
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if _current is self:
            _current = None

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
            raise SignalExit(self.received)

    # -- the handler ------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
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
        raise SignalExit(self.received)
