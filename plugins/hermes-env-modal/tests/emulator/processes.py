"""Real local processes behind emulated execs and sandbox entrypoints.

Everything here runs on the emulator's own asyncio loop. Each process is started in
a new session (so it leads its own process group), its stdout/stderr are read as they
arrive into append-only buffers that readers consume by byte offset (the protocol's
resume model), and stdin is written at client-supplied offsets so retried writes are
idempotent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

READ_CHUNK = 64 * 1024


class _ExitAwareProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Also reports the moment the process itself exits.

    ``asyncio.subprocess.Process.wait()`` returns only once every pipe is closed too,
    so a background child that keeps stdout open (``sleep 300 &``) would hold back the
    exit status for as long as it runs. A container runtime reports an exec's exit when
    its process exits; ``exited`` gives that moment and the status.
    """

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[int] = loop.create_future()

    def process_exited(self) -> None:
        transport = self._transport
        rc = transport.get_returncode() if transport is not None else None
        if not self.exited.done():
            self.exited.set_result(rc if rc is not None else -1)
        super().process_exited()


class OutputBuffer:
    """Append-only byte log of one pipe, with waiters for new data / EOF.

    ``delay`` (the emulator's ``output_delay`` knob) makes each chunk, and the
    EOF, visible to readers only that long after the process wrote it, in order.
    The real service carries output on a stream of its own (``TaskExecStdioRead``,
    offset-resumable, see ``_stream_stdio_with_retries`` in the SDK's
    ``modal/sandbox/_task_command_router_client.py``) and the exit status on
    another (``TaskExecWait``); nothing orders one after the other, so output
    may arrive after the exit status.
    """

    def __init__(self, delay: float = 0.0) -> None:
        self.data = bytearray()
        self.eof = False
        self.delay = delay
        self._changed = asyncio.Event()
        self._pending: deque[tuple[float, bytes | None]] = deque()
        self._deliverer: asyncio.Task | None = None

    def append(self, chunk: bytes) -> None:
        if self.delay > 0 or self._pending:
            self._later(chunk)
            return
        self.data.extend(chunk)
        self._wake()

    def close(self) -> None:
        if self.delay > 0 or self._pending:
            self._later(None)
            return
        self.eof = True
        self._wake()

    def _later(self, chunk: bytes | None) -> None:
        loop = asyncio.get_running_loop()
        self._pending.append((loop.time() + self.delay, chunk))
        if self._deliverer is None or self._deliverer.done():
            self._deliverer = loop.create_task(self._deliver())

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            when, chunk = self._pending[0]
            if when > loop.time():
                await asyncio.sleep(when - loop.time())
            self._pending.popleft()
            if chunk is None:
                self.eof = True
            else:
                self.data.extend(chunk)
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def chunks(self, offset: int, max_chunk: int = READ_CHUNK):
        """Yield non-empty chunks from ``offset`` on, as they arrive, until EOF."""
        while True:
            if offset < len(self.data):
                chunk = bytes(self.data[offset : offset + max_chunk])
                offset += len(chunk)
                yield offset - len(chunk), chunk
                continue
            if self.eof:
                return
            await self._changed.wait()


@dataclass
class LocalProcess:
    """One running (or finished) process: an exec or a sandbox entrypoint."""

    id: str
    argv: list[str]
    cwd: str
    stdout: OutputBuffer = field(default_factory=OutputBuffer)
    stderr: OutputBuffer = field(default_factory=OutputBuffer)
    returncode: int | None = None
    timed_out: bool = False
    killed: bool = False
    started_at: float = 0.0
    finished_at: float | None = None
    stdin_offset: int = 0
    stdin_closed: bool = False
    stdin_received: bytearray = field(default_factory=bytearray)  # for tests: what the exec was fed
    _proc: asyncio.subprocess.Process | None = None
    _exit: asyncio.Future | None = None
    _exited: asyncio.Event = field(default_factory=asyncio.Event)
    # When the service reports the exit status (TaskExecWait/TaskExecPoll): the
    # emulator's ``exit_status_delay`` after the process exited.
    exit_status_delay: float = 0.0
    _reported: asyncio.Event = field(default_factory=asyncio.Event)
    _stdin_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _tasks: list = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def exit_signal(self) -> int | None:
        if self.returncode is not None and self.returncode < 0:
            return -self.returncode
        return None

    def done(self) -> bool:
        return self._exited.is_set()

    async def start(
        self,
        env: dict[str, str],
        *,
        pipe_stdout: bool = True,
        pipe_stderr: bool = True,
        timeout: float | None = None,
    ) -> None:
        self.started_at = time.monotonic()
        try:
            loop = asyncio.get_running_loop()
            transport, protocol = await loop.subprocess_exec(
                lambda: _ExitAwareProtocol(2**16, loop),  # asyncio's default stream limit
                *self.argv,
                cwd=self.cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE if pipe_stdout else subprocess.DEVNULL,
                stderr=subprocess.PIPE if pipe_stderr else subprocess.DEVNULL,
                start_new_session=True,
            )
            self._proc = asyncio.subprocess.Process(transport, protocol, loop)
            self._exit = protocol.exited
        except (FileNotFoundError, PermissionError, NotADirectoryError, OSError) as exc:
            # A container runtime reports these as a failed exec; we report them the way a
            # shell would (127 command not found / 126 not executable or cwd unusable).
            missing_cmd = isinstance(exc, FileNotFoundError) and os.path.isdir(self.cwd)
            self.stderr.append(
                f"modal-emulator: cannot exec {self.argv[0]!r}: {exc}\n".encode()
            )
            self.stdout.close()
            self.stderr.close()
            self.stdin_closed = True
            self._finish(127 if missing_cmd else 126)
            return
        if pipe_stdout:
            self._tasks.append(
                loop.create_task(self._pump(self._proc.stdout, self.stdout))
            )
        else:
            self.stdout.close()
        if pipe_stderr:
            self._tasks.append(
                loop.create_task(self._pump(self._proc.stderr, self.stderr))
            )
        else:
            self.stderr.close()
        self._tasks.append(loop.create_task(self._reap()))
        if timeout:
            self._tasks.append(loop.create_task(self._deadline(timeout)))

    async def _pump(self, reader: asyncio.StreamReader, buf: OutputBuffer) -> None:
        try:
            while True:
                chunk = await reader.read(READ_CHUNK)
                if not chunk:
                    break
                buf.append(chunk)
        finally:
            buf.close()

    async def _reap(self) -> None:
        assert self._exit is not None
        rc = await self._exit  # the process's own exit, not its pipes'
        self._finish(rc)

    def _finish(self, rc: int) -> None:
        if self._exited.is_set():
            return
        self.returncode = rc
        self.finished_at = time.monotonic()
        self.stdin_closed = True
        self._exited.set()
        if self.exit_status_delay > 0:
            asyncio.get_running_loop().call_later(self.exit_status_delay, self._reported.set)
        else:
            self._reported.set()

    def reported(self) -> bool:
        """Whether the service has the exit status to report yet."""
        return self._reported.is_set()

    async def wait_reported(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._reported.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def _deadline(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
        except TimeoutError:
            self.timed_out = True
            self.kill()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the exec and everything it started)."""
        if self._proc is None:
            return
        if not self.done():
            self.killed = True
        # Signal even when the leader is gone: children may still hold the pipes open.
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def wait(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def write_stdin(self, offset: int, data: bytes, eof: bool) -> int:
        """Write ``data`` that starts at stream position ``offset``; skip what was already written.

        Returns the number of bytes written so far. Raises ``BrokenPipeError`` if the
        process can no longer take input and new bytes were offered, ``ValueError`` on a gap.
        """
        async with self._stdin_lock:
            if offset > self.stdin_offset:
                raise ValueError(
                    f"stdin offset {offset} is past the {self.stdin_offset} bytes written"
                )
            fresh = data[self.stdin_offset - offset :]
            if fresh:
                if self.stdin_closed or self._proc is None or self._proc.stdin is None:
                    raise BrokenPipeError("stdin is closed")
                try:
                    self._proc.stdin.write(fresh)
                    await self._proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError) as exc:
                    self.stdin_closed = True
                    raise BrokenPipeError(str(exc)) from exc
                self.stdin_offset += len(fresh)
                self.stdin_received += fresh
            if eof and not self.stdin_closed:
                self.stdin_closed = True
                if self._proc is not None and self._proc.stdin is not None:
                    self._proc.stdin.close()
            return self.stdin_offset

    async def shutdown(self, grace: float = 5.0) -> None:
        """Kill the group and wait (bounded) for the pumps to finish."""
        self.kill()
        await self.wait(grace)
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=grace)
            for t in pending:
                t.cancel()
