"""What keeps a host tree consistent while a pull writes into it: a
cross-process lock per tree, and Ctrl-C deferred until the writes are done.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from ..errors import SyncError

__all__ = ["TreeLock", "default_lock_dir", "defer_sigint"]


def default_lock_dir() -> str:
    """Per-user directory for lock files: outside every synced tree."""
    uid = os.getuid() if hasattr(os, "getuid") else getpass.getuser()
    return os.path.join(tempfile.gettempdir(), f"hermes-env-sync-locks-{uid}")


class TreeLock:
    """An exclusive lock on one host tree, held across processes and threads.

    It is a ``flock`` on a file named after the tree's real path, so two
    engines in two processes (or two threads) pulling into the same tree take
    turns. The kernel drops it when the holder dies.
    """

    def __init__(self, tree: str, *, lock_dir: str | None = None, timeout: float | None = 600.0,
                 on_wait: Callable[[], None] | None = None) -> None:
        self.tree = os.path.realpath(tree)
        digest = hashlib.sha256(os.fsencode(self.tree)).hexdigest()[:32]
        self.lock_dir = lock_dir or default_lock_dir()
        self.path = os.path.join(self.lock_dir, f"{digest}.lock")
        self.timeout = timeout
        self.on_wait = on_wait
        self._fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not _try_lock(fd):
                if self.on_wait is not None:
                    self.on_wait()
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
                delay = 0.001
                while not _try_lock(fd):
                    if deadline is not None and time.monotonic() >= deadline:
                        raise SyncError(
                            f"another pull into {self.tree} has held {self.path} for over {self.timeout:g}s; "
                            "wait for it to finish or remove the lock file if no hermes-env process runs"
                        )
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _unlock(fd)
            os.close(fd)

    def __enter__(self) -> TreeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def defer_sigint() -> Iterator[list[int]]:
    """Hold SIGINT back until the block ends, then deliver it.

    Only the main thread receives signals, so elsewhere this does nothing. A
    deferred Ctrl-C is re-raised through the previous handler once the block
    has finished (normally: ``KeyboardInterrupt`` right after it).
    """
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    received: list[int] = []

    def hold(signum: int, frame: object) -> None:
        received.append(signum)

    try:
        previous = signal.signal(signal.SIGINT, hold)
    except ValueError:  # not the main interpreter
        yield []
        return
    try:
        yield received
    finally:
        # None: the old handler was not set from Python; the default is the best we can do.
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        if received:
            signal.raise_signal(signal.SIGINT)
