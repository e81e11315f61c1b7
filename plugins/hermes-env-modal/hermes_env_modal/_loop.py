"""The one background event loop an environment runs the SDK's async calls on.

Started once when the environment is built and stopped once when it is closed
(or when building it failed); blocking callers hand it coroutines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hermes_env_core.errors import EnvironmentClosedError

__all__ = ["EventLoopThread"]

T = TypeVar("T")


class EventLoopThread:
    """An asyncio loop in a daemon thread. ``start()`` and ``stop()`` each act once."""

    def __init__(self, name: str = "hermes-env-modal-loop") -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> EventLoopThread:
        with self._lock:
            if self._thread is not None or self._stopped:
                raise RuntimeError(f"{self.name}: the loop is started only once")
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            self.loop = loop
            self._thread = threading.Thread(target=self._main, args=(loop, ready), name=self.name, daemon=True)
            self._thread.start()
        ready.wait()
        return self

    @staticmethod
    def _main(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            # Whatever is still pending (a command nobody waits for) is cancelled,
            # so that no SDK call outlives the environment.
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the caller gets a thread-safe future."""
        loop = self.loop
        if loop is None or self._stopped:
            coro.close()
            raise EnvironmentClosedError(f"{self.name}: the event loop is stopped")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (``TimeoutError`` past ``timeout``)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"{self.name}: run() called from the loop's own thread would deadlock")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.name}: call did not finish within {timeout:g}s") from None
        except concurrent.futures.CancelledError:
            raise EnvironmentClosedError(f"{self.name}: the call was cancelled (environment closing)") from None

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the loop thread (ignored once the loop has stopped)."""
        loop = self.loop
        if loop is None or self._stopped:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed in between
            pass

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join its thread. Later calls do nothing."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
        if thread is not threading.current_thread():
            thread.join(timeout)
