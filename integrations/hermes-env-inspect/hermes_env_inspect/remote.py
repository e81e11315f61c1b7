"""``exec_remote`` through the session's own output stream: no tools installed in the target, no polling.

stdout arrives as it is written; stderr (kept in a file in the target) as one
event when the command ends, just before ``ExecCompleted``.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

import anyio
from inspect_ai.util import (
    ExecCompleted,
    ExecOutput,
    ExecRemoteAwaitableOptions,
    ExecRemoteProcess,
    ExecRemoteStreamingOptions,
    ExecResult,
    ExecStderr,
    ExecStdout,
    SandboxEnvironmentLimits,
    SandboxUserUnsupportedError,
)

from hermes_env_core.aio import ExecStream

from . import scripts

if TYPE_CHECKING:
    from .sandbox import HermesSandboxEnvironment

__all__ = ["HermesRemoteProcess", "run_awaitable"]


class HermesRemoteProcess(ExecRemoteProcess):
    """An ``ExecRemoteProcess`` fed by a hermes-env ``ExecStream`` (``pid`` is 0: the session knows no pid)."""

    def __init__(self, sandbox: HermesSandboxEnvironment, cmd: list[str], options: Any) -> None:
        super().__init__(sandbox, cmd, options, sandbox.default_polling_interval())
        self._hermes = sandbox
        self._tag = scripts.new_tag()
        self._stream: ExecStream | None = None
        self._buffer = ""
        self._started_line = False
        self._done_stdout = False

    @classmethod
    async def launch(
        cls,
        sandbox: HermesSandboxEnvironment,
        cmd: list[str],
        options: ExecRemoteStreamingOptions | ExecRemoteAwaitableOptions,
    ) -> HermesRemoteProcess:
        """Start ``cmd``; returns once the target has begun running it."""
        proc = cls(sandbox, cmd, options)
        proc._stream = await sandbox._remote_stream(cmd, options, proc._tag)
        proc._stream.start()
        proc._pid = 0
        marker = proc._tag + "-started\n"
        try:
            while len(proc._buffer) < len(marker):
                chunk = await proc._next_chunk()
                if chunk is None:
                    break
                proc._buffer += chunk
        except BaseException:
            await proc.kill()
            raise
        if not proc._buffer.startswith(marker):
            await proc.kill()
            raise scripts.ProtocolError(f"the command did not start: {proc._buffer[:500]!r}")
        proc._buffer = proc._buffer[len(marker) :]
        return proc

    async def _next_chunk(self) -> str | None:
        assert self._stream is not None
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            return None

    def _take_stdout(self, final: bool) -> str:
        """stdout that is surely not the start of the closing line; all of it once ``final``."""
        trailer = self._tag + " "
        at = self._buffer.find(trailer)
        if at >= 0:
            out, self._buffer = self._buffer[:at], self._buffer[at:]
            self._done_stdout = True
            return out
        if final:
            out, self._buffer = self._buffer, ""
            return out
        keep = len(trailer) - 1
        cut = max(0, len(self._buffer) - keep)
        # keep back only a tail that could begin the closing line
        while cut < len(self._buffer) and not trailer.startswith(self._buffer[cut:]):
            cut += 1
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out

    def _finish(self) -> list[ExecOutput]:
        assert self._stream is not None
        result = self._stream.result
        if result.timed_out or result.interrupted:
            self._killed = True
            return []
        answer = scripts.parse_answer(self._tag, self._buffer)
        fields = answer.fields
        if len(fields) < 4:
            raise scripts.ProtocolError(f"bad exec_remote answer: {fields!r}")
        if fields[2] == "nouser":
            raise SandboxUserUnsupportedError(f"cannot run as user {self._options.user!r}: {' '.join(fields[3:])}")
        if fields[2] == "exec" and fields[3] == "126":
            raise PermissionError(errno.EACCES, f"permission denied executing {self._cmd[0]!r}")
        err, _ = scripts.decode_block(answer.rest)
        self._completed = True
        events: list[ExecOutput] = []
        if err:
            events.append(ExecStderr(data=err.decode("utf-8", errors="replace")))
        events.append(ExecCompleted(exit_code=int(fields[0])))
        return events

    async def __anext__(self) -> ExecOutput:
        if self._pid is None:
            raise RuntimeError("Process has not been submitted yet")
        try:
            while True:
                if self._pending_events:
                    return self._pending_events.pop(0)
                if self._completed or self._killed:
                    raise StopAsyncIteration
                if not self._done_stdout:
                    out = self._take_stdout(final=False)
                    if out:
                        return ExecStdout(data=out)
                chunk = await self._next_chunk()
                if chunk is None:
                    if not self._done_stdout:
                        out = self._take_stdout(final=True)
                        if out:
                            self._pending_events.append(ExecStdout(data=out))
                    self._pending_events += self._finish()
                    continue
                self._buffer += chunk
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self.kill()
            raise

    async def kill(self) -> None:
        """Stop the command and its whole tree (no ``ExecCompleted`` follows)."""
        if self._completed or self._killed:
            return
        self._killed = True
        if self._stream is not None:
            await self._stream.aclose()

    async def write_stdin(self, data: str | bytes) -> None:
        raise RuntimeError("write_stdin() requires stdin_open=True in ExecRemoteStreamingOptions")

    async def close_stdin(self) -> None:
        raise RuntimeError("close_stdin() requires stdin_open=True in ExecRemoteStreamingOptions")


async def run_awaitable(
    sandbox: HermesSandboxEnvironment, cmd: list[str], options: ExecRemoteAwaitableOptions
) -> ExecResult[str]:
    """``exec_remote(stream=False)``: the last ``MAX_EXEC_OUTPUT_SIZE`` bytes of each stream; TimeoutError on ``timeout``."""
    limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
    proc = await HermesRemoteProcess.launch(sandbox, cmd, ExecRemoteStreamingOptions(
        input=options.input, cwd=options.cwd, env=options.env, user=options.user
    ))
    out, err = bytearray(), bytearray()
    try:
        with anyio.fail_after(options.timeout):
            async for event in proc:
                if isinstance(event, ExecStdout):
                    out += event.data.encode("utf-8")
                    del out[:-limit]
                elif isinstance(event, ExecStderr):
                    err += event.data.encode("utf-8")
                    del err[:-limit]
                elif isinstance(event, ExecCompleted):
                    return ExecResult(
                        success=event.success,
                        returncode=event.exit_code,
                        stdout=out.decode("utf-8", errors="replace"),
                        stderr=err.decode("utf-8", errors="replace"),
                    )
    except TimeoutError:
        with anyio.CancelScope(shield=True):
            await proc.kill()
        raise
    return ExecResult(
        success=False,
        returncode=-1,
        stdout=out.decode("utf-8", errors="replace"),
        stderr=err.decode("utf-8", errors="replace"),
    )
