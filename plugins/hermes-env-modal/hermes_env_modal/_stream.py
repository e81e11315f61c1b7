"""One Modal exec as the core's byte stream (``ChannelStream``), and a helper's handle on it.

stdin is written with ``proc.stdin.write`` + ``drain`` (one router RPC per
write, offset-tracked by the SDK); stdout is read on the environment's event
loop as it streams and handed to the reading thread through a queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hermes_env_core.environment.handles import ThreadedProcessHandle, Writer
from hermes_env_core.errors import BackendError

if TYPE_CHECKING:
    from ._loop import EventLoopThread

__all__ = ["ExecStream", "HelperProcess"]

_STDIN_CHUNK = 1024 * 1024  # one stdin write RPC; the SDK buffers at most 16 MiB
_WRITE_S = 120.0  # bound on one write RPC (the SDK retries transient errors inside it)
# Output may trail the exit status (separate RPCs, see the emulator's output_delay):
# once the process has exited, its stream is read this much longer. Past it a
# background child still holding stdout no longer keeps the stream open.
_TRAIL_S = 2.0
# Modal's exit status is a 60 s long-poll (``exec_wait`` in
# modal/sandbox/_task_command_router_client.py, SDK 1.6), retried 1 s apart.
EXIT_STATUS_WAIT_S = 65.0


class ExecStream:
    """A bidirectional byte stream over one exec; its stderr is kept (its first 64 KiB) if read at all."""

    def __init__(self, loop: EventLoopThread, proc: Any, *, stderr: bool = False) -> None:
        self._loop = loop
        self._proc = proc
        self._read_stderr = stderr
        self.stderr = bytearray()
        self._chunks: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._buf = b""
        self._ended = False
        self._closed = False
        self._lock = asyncio.Lock()
        #: the exec's exit status once Modal has given it (an SDK error if it could not)
        self.exit_status: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._pump = loop.submit(self._run())

    async def _run(self) -> None:
        reader = asyncio.ensure_future(self._read())
        waiter = asyncio.ensure_future(self._proc.wait.aio())
        waiter.add_done_callback(self._exited)
        try:
            try:
                await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not reader.done():
                    await asyncio.wait({reader}, timeout=_TRAIL_S)
            finally:
                reader.cancel()
                self._chunks.put(b"")
            await asyncio.wait({waiter})
        finally:
            waiter.cancel()

    def _exited(self, task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            self.exit_status.set_exception(BackendError("modal: stopped waiting for the exec's exit status"))
        elif task.exception() is not None:
            self.exit_status.set_exception(task.exception())  # type: ignore[arg-type]
        else:
            self.exit_status.set_result(int(task.result()))

    async def _read(self) -> None:
        async def errors() -> None:
            async for chunk in self._proc.stderr:
                self.stderr += chunk[: max(0, 65536 - len(self.stderr))]

        side = asyncio.ensure_future(errors()) if self._read_stderr else None
        try:
            async for chunk in self._proc.stdout:
                if chunk:
                    self._chunks.put(bytes(chunk))
            if side is not None:
                await side
        finally:
            if side is not None:
                side.cancel()

    def read(self, n: int) -> bytes:
        if not self._buf:
            if self._ended or self._closed:
                return b""
            self._buf = self._chunks.get()
            if not self._buf or self._closed:
                self._ended = True
                return b""
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def write(self, data: bytes) -> None:
        self._send(bytes(data), eof=False)

    def finish_input(self) -> None:
        """Send EOF to the exec's stdin."""
        self._send(b"", eof=True)

    def _send(self, data: bytes, *, eof: bool) -> None:
        if self._closed:
            raise BrokenPipeError("modal: the exec stream is closed")
        try:
            self._loop.run(self._write(data, eof), timeout=_WRITE_S)
        except Exception as exc:
            raise BrokenPipeError(f"modal: writing to the exec failed: {type(exc).__name__}: {exc}") from exc

    async def _write(self, data: bytes, eof: bool) -> None:
        async with self._lock:  # drain() tracks one offset: writes take turns
            stdin = self._proc.stdin
            for start in range(0, len(data), _STDIN_CHUNK):
                stdin.write(data[start : start + _STDIN_CHUNK])
                await stdin.drain.aio()
            if eof:
                stdin.write_eof()
                await stdin.drain.aio()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop reading and close the exec's stdin (a server reading it exits); never blocks."""
        if self._closed:
            return
        self._closed = True
        self._chunks.put(b"")
        self._pump.cancel()
        try:
            self._loop.submit(self._shut())
        except Exception:  # noqa: BLE001 - the loop is stopped: the sandbox goes with it
            pass

    async def _shut(self) -> None:
        try:
            await asyncio.wait_for(self._write(b"", True), _WRITE_S)
        except Exception:  # noqa: BLE001 - the exec may be gone already
            pass


class HelperProcess(ThreadedProcessHandle):
    """A script run to its end on its own exec: output from the stream, the exit status from Modal."""

    def __init__(self, stream: ExecStream, stdin: bytes | None, *, on_kill: Callable[[], None], name: str) -> None:
        self._stream = stream
        self._stdin = stdin
        super().__init__(self._follow, on_kill=on_kill, name=name)

    def _follow(self, write: Writer) -> int:
        stream = self._stream
        try:
            if self._stdin:
                stream.write(self._stdin)
            stream.finish_input()
        except OSError:
            pass  # the script may not read its stdin and be gone; its exit status says
        while data := stream.read(1 << 20):
            write(data)
        try:
            return stream.exit_status.result(EXIT_STATUS_WAIT_S)
        except concurrent.futures.TimeoutError:
            raise BackendError(f"modal: no exit status for a helper within {EXIT_STATUS_WAIT_S:g}s") from None
        finally:
            stream.close()
