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
from hermes_env_core.errors import BackendError

if TYPE_CHECKING:
    from ._loop import EventLoopThread

__all__ = ["OutputBridge", "SandboxProcess", "pump"]

_BRIDGE_LIMIT = 4 * 1024 * 1024  # bytes held between the loop and the pipe
# How long the exit status may take once the command has reported. Modal's own
# wait (``exec_wait`` in modal/sandbox/_task_command_router_client.py, SDK 1.6)
# is a 60 s long-poll, retried 1 s apart for as long as the exec lives; one
# full long-poll plus its pause and a margin is what we grant before calling the
# exec lost. There is no sentinel: past it the command fails loudly.
EXIT_STATUS_WAIT_S = 65.0
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
    """Stream an exec's output into ``bridge`` and return its exit status.

    Returns once Modal has given the exit status and either the output streams
    have ended or the base class has the command's own report (``reaping``:
    a background child may hold the streams open for ever). Output may arrive
    after the exit status, so the status alone never ends the reading. The
    exit status is waited for as long as the SDK's wait waits; an SDK error
    propagates (the handle reports it, never a made-up code).
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
    try:
        while not (waiter.done() and (reaping.is_set() or all(r.done() for r in readers))):
            done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not asked and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        return int(waiter.result())
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
        return self._done_future.result(timeout=EXIT_STATUS_WAIT_S)

    def wait(self, timeout: float | None = None) -> int:
        if not self._asked:
            # The base class reads no more output: the pump may stop reading.
            self._asked = True
            self._loop.call_soon(self._reaping.set)
        if timeout is not None:
            # The base class bounds this wait for a local process; Modal's exit
            # status is a long-poll, waited for as long as the SDK waits.
            timeout = max(timeout, EXIT_STATUS_WAIT_S)
        try:
            return super().wait(timeout)
        except TimeoutError:
            self.kill()  # whatever of it still runs
            raise BackendError(
                f"modal: the command reported its end but Modal gave no exit status within "
                f"{timeout:g}s (exec {self.token}); its result is unknown"
            ) from None
