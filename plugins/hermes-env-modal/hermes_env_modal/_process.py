"""A command running in a Modal sandbox, seen by the base class as a process.

The SDK's output arrives on the environment's event loop; a bounded bridge
hands it to the handle's own thread, which alone writes the pipe the base class
reads, so a slow reader can never stall the loop (and with it a kill).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hermes_env_core.environment.handles import ThreadedProcessHandle, Writer

if TYPE_CHECKING:
    from ._loop import EventLoopThread

__all__ = ["OutputBridge", "SandboxProcess", "pump"]

_BRIDGE_LIMIT = 4 * 1024 * 1024  # bytes held between the loop and the pipe
# How long to keep reading after the command's exit is known, when the base
# class has not asked for the exit code yet (a background child may hold the
# pipe open for ever; the base class stops reading once it has its frame).
_LINGER_S = 0.5
# Once the base class has the command's report, how long an exit status may lag.
_REAP_GRACE_S = 2.0
_STDIN_CHUNK = 1024 * 1024  # one stdin write RPC; the SDK buffers at most 16 MiB


class OutputBridge:
    """Chunks from the event loop to one consumer thread, at most ~4 MiB held."""

    def __init__(self, loop: EventLoopThread, limit: int = _BRIDGE_LIMIT) -> None:
        self._loop = loop
        self._limit = limit
        self._cv = threading.Condition()
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._closed = False
        self._space: asyncio.Event | None = None

    async def put(self, data: bytes) -> None:
        """Queue ``data`` (on the loop); waits while the consumer is behind."""
        while True:
            with self._cv:
                if self._size < self._limit or self._closed:
                    if not self._closed:
                        self._chunks.append(data)
                        self._size += len(data)
                        self._cv.notify()
                    return
                if self._space is None:
                    self._space = asyncio.Event()
                self._space.clear()
                space = self._space
            await space.wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _wake_producer(self) -> None:
        if self._space is not None:
            self._space.set()

    def drain(self, write: Writer, alive: Callable[[], bool]) -> None:
        """Write every chunk until the bridge is closed (in the consumer thread)."""
        while True:
            with self._cv:
                while not self._chunks and not self._closed:
                    self._cv.wait(0.5)
                    if not self._chunks and not self._closed and not alive():
                        return
                batch = list(self._chunks)
                self._chunks.clear()
                was_full = self._size >= self._limit
                self._size = 0
                closed = self._closed
            if was_full:
                self._loop.call_soon(self._wake_producer)
            for chunk in batch:
                write(chunk)
            if closed:
                return


async def _read_into(stream: Any, bridge: OutputBridge) -> None:
    async for chunk in stream:
        if chunk:
            await bridge.put(chunk if isinstance(chunk, bytes) else chunk.encode("utf-8"))


async def write_stdin(proc: Any, data: bytes) -> None:
    """Send ``data`` and EOF to an exec's stdin, in chunks the SDK accepts."""
    view = memoryview(data)
    for start in range(0, len(view), _STDIN_CHUNK):
        proc.stdin.write(view[start : start + _STDIN_CHUNK])
        await proc.stdin.drain.aio()
    proc.stdin.write_eof()
    await proc.stdin.drain.aio()


async def pump(
    proc: Any,
    bridge: OutputBridge,
    *,
    read_stderr: bool,
    upload: bytes | None,
    reaping: asyncio.Event,
) -> int:
    """Stream an exec's output into ``bridge`` and return its exit code.

    After the exit, output is read until the streams end, the base class asks
    for the exit code (``reaping``), or a short linger passes. Once the base
    class has asked (it has the command's own report, exit code included),
    an exit status Modal is slow to give is not waited for past a grace.
    """
    readers = [asyncio.ensure_future(_read_into(proc.stdout, bridge))]
    if read_stderr:
        readers.append(asyncio.ensure_future(_read_into(proc.stderr, bridge)))
    waiter = asyncio.ensure_future(proc.wait.aio())
    asked = asyncio.ensure_future(reaping.wait())
    feeder = asyncio.ensure_future(write_stdin(proc, upload)) if upload is not None else None
    tasks: set[asyncio.Future[Any]] = {waiter, asked, *readers}
    if feeder is not None:
        tasks.add(feeder)
    asked_at: float | None = None
    loop = asyncio.get_running_loop()
    try:
        while not waiter.done():
            timeout = None if asked_at is None else max(0.0, asked_at + _REAP_GRACE_S - loop.time())
            done, tasks = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done and asked_at is not None:
                return -1  # the base class uses the exit code the command reported
            for task in done:
                if task is asked:
                    asked_at = loop.time()
                elif task is not waiter and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        code = waiter.result()
        pending = [r for r in readers if not r.done()]
        if pending and not reaping.is_set():
            all_read = asyncio.ensure_future(asyncio.wait(pending))
            await asyncio.wait([all_read, asked], timeout=_LINGER_S, return_when=asyncio.FIRST_COMPLETED)
            all_read.cancel()
        for reader in readers:
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        return int(code)
    finally:
        for task in (*readers, waiter, asked, *(t for t in (feeder,) if t is not None)):
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: no "never retrieved" warning
        bridge.close()


class SandboxProcess(ThreadedProcessHandle):
    """The handle of one exec: ``poll``/``wait``/``kill`` over the loop's future.

    ``token`` is written into the exec's command line so that a kill can tell
    this command's bash from any other (see ``DirectModalEnvironment._kill_tree``).
    """

    def __init__(
        self,
        loop: EventLoopThread,
        bridge: OutputBridge,
        done: concurrent.futures.Future[int],
        reaping: asyncio.Event,
        *,
        token: str,
        on_kill: Callable[[], None],
    ) -> None:
        self.token = token
        self.pids: tuple[int, ...] = ()
        self._loop = loop
        self._bridge = bridge
        self._done_future = done
        self._reaping = reaping
        self._asked = False
        super().__init__(self._target, on_kill=on_kill, name=f"hermes-env-modal-exec-{token}")

    def _target(self, write: Writer) -> int:
        self._bridge.drain(write, alive=lambda: self._loop.running and not self._done_future.done())
        return self._done_future.result(timeout=30.0)

    def wait(self, timeout: float | None = None) -> int:
        if not self._asked:
            # The base class reads no more output: the pump may stop lingering.
            self._asked = True
            self._loop.call_soon(self._reaping.set)
        return super().wait(timeout)
