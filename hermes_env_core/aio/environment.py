"""``AsyncEnvironment``: the sync environment driven from asyncio, one worker thread per call in flight.

Cancelling the awaiting task sets the sync API's ``cancel`` event, waits until
``execute()`` has returned (the command's whole tree is gone by then), and
re-raises ``CancelledError``; the session stays usable.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from ..environment import BaseEnvironment, CancelToken, ExecResult
from ..factory import create_environment as _create_sync

__all__ = ["AsyncEnvironment", "ExecStream", "create_environment", "run_in_thread"]

T = TypeVar("T")

#: Threads for blocking calls; a command in flight holds one. Sized for many
#: concurrent sessions (the loop's default executor has min(32, cpus + 4)).
MAX_THREADS = int(os.environ.get("HERMES_ENV_AIO_THREADS", "512"))

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _get_executor() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="hermes-env-aio")
        return _executor


async def run_in_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run the blocking ``fn(*args, **kwargs)`` on the aio executor (context variables carried over).

    Cancelling the caller does not stop ``fn``: it is waited for, then
    ``CancelledError`` is raised. Use ``AsyncEnvironment.execute`` for
    commands, whose cancel stops the command itself.
    """
    return await _wait_thread(fn, args, kwargs, on_cancel=None)


async def _wait_thread(
    fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], *, on_cancel: Callable[[], None] | None
) -> T:
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    fut = loop.run_in_executor(_get_executor(), call)
    try:
        # asyncio.wait never cancels ``fut``: the thread runs on whatever happens here.
        await asyncio.wait([fut])
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                continue
        if not fut.cancelled():
            fut.exception()  # retrieved: the caller gets CancelledError, not this
        raise
    return fut.result()


async def create_environment(name: str | None = None, /, **options: Any) -> AsyncEnvironment:
    """``hermes_env_core.create_environment`` (same arguments), as an ``AsyncEnvironment``."""
    env = await run_in_thread(_create_sync, name, **options)
    return AsyncEnvironment(env)


class AsyncEnvironment:
    """An environment for asyncio code: ``execute``, ``stream``, ``close`` and ``async with``.

    ``sync`` is the wrapped ``BaseEnvironment``; both may be used at once
    (execution is thread-safe). Commands from many tasks on one environment take
    turns, as in one shell; many environments run concurrently.
    """

    def __init__(self, env: BaseEnvironment) -> None:
        self._env = env

    @property
    def sync(self) -> BaseEnvironment:
        return self._env

    @property
    def closed(self) -> bool:
        return self._env.closed

    @property
    def task_id(self) -> str:
        return self._env.task_id

    async def _run(
        self,
        command: str,
        *,
        cwd: str | None,
        timeout: float | None,
        stdin: str | bytes | None,
        on_output: Callable[[str], None] | None,
    ) -> ExecResult:
        # The one seam between asyncio and the sync execution core.
        cancel = CancelToken()
        return await _wait_thread(
            self._env.execute,
            (command,),
            {"cwd": cwd, "timeout": timeout, "stdin": stdin, "cancel": cancel, "on_output": on_output},
            on_cancel=cancel.set,
        )

    async def execute(
        self,
        command: str,
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> ExecResult:
        """Run ``command`` as the sync ``execute()`` does; cancelling the task stops it and its whole tree."""
        return await self._run(command, cwd=cwd, timeout=timeout, stdin=stdin, on_output=None)

    def stream(
        self,
        command: str,
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> ExecStream:
        """``async for chunk in env.stream(cmd)``: output as it comes (str), then ``.result``.

        The command starts at the first iteration. Leaving the loop early does
        not stop it: use ``async with env.stream(cmd) as s`` or ``await s.aclose()``.
        """
        return ExecStream(self, command, cwd=cwd, timeout=timeout, stdin=stdin)

    async def close(self) -> None:
        """Close the environment (a running command is stopped first)."""
        await run_in_thread(self._env.close)

    async def __aenter__(self) -> AsyncEnvironment:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncEnvironment {self._env!r}>"


_END = object()


class ExecStream:
    """One streamed command: an async iterator of output chunks, then ``result``."""

    def __init__(
        self, env: AsyncEnvironment, command: str, *, cwd: str | None, timeout: float | None, stdin: str | bytes | None
    ) -> None:
        self._env = env
        self._args: dict[str, Any] = {"cwd": cwd, "timeout": timeout, "stdin": stdin}
        self._command = command
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task: asyncio.Task[ExecResult] | None = None
        self._finished = False

    def start(self) -> None:
        """Start the command now rather than at the first iteration (needs a running loop)."""
        self._start()

    def _start(self) -> asyncio.Task[ExecResult]:
        if self._task is None:
            loop = asyncio.get_running_loop()
            put = self._queue.put_nowait

            def on_output(text: str) -> None:  # a worker thread
                loop.call_soon_threadsafe(put, text)

            self._task = loop.create_task(self._env._run(self._command, on_output=on_output, **self._args))
            self._task.add_done_callback(lambda _t: put(_END))
        return self._task

    @property
    def started(self) -> bool:
        return self._task is not None

    @property
    def result(self) -> ExecResult:
        """The command's ``ExecResult`` once the iteration has ended (raises what ``execute`` raised)."""
        if self._task is None or not self._task.done():
            raise RuntimeError("the command has not finished: iterate the stream to its end first")
        return self._task.result()

    async def wait(self) -> ExecResult:
        """Run to the end (chunks not yet read are dropped) and return the result."""
        async for _ in self:
            pass
        return self.result

    def __aiter__(self) -> ExecStream:
        return self

    async def __anext__(self) -> str:
        task = self._start()
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            await self._stop(task)
            raise
        if item is _END:
            self._finished = True
            task.result()  # raise what execute() raised
            raise StopAsyncIteration
        assert isinstance(item, str)
        return item

    async def _stop(self, task: asyncio.Task[ExecResult]) -> None:
        task.cancel()
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                continue

    async def aclose(self) -> None:
        """Stop the command if it still runs, and wait until it is gone."""
        if self._task is not None and not self._task.done():
            await self._stop(self._task)

    async def __aenter__(self) -> ExecStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
