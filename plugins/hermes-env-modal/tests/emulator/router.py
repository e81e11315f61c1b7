"""The task command router (``modal.task_command_router.TaskCommandRouter``).

The client reaches it at the URL/JWT handed out by ``SandboxCreateV2`` or
``SandboxGetCommandRouterAccess`` and sends ``authorization: Bearer <jwt>``.
Exec, its stdio and stdin, and filesystem snapshots go through here.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from grpclib import GRPCError, Status
from modal_proto import task_command_router_pb2 as sr_pb2

from .processes import LocalProcess
from .state import FS_TOOLS_PATH, env_from_secret_sources

if TYPE_CHECKING:
    from .server import ModalEmulator

FS_TOOLS_SCRIPT = Path(__file__).with_name("fs_tools.py")
# What an Envoy-style proxy answers when it resets a held upstream request; the
# SDK treats UNAVAILABLE as transient (RETRYABLE_GRPC_STATUS_CODES in
# modal/_utils/grpc_utils.py). The exact wording the real front end uses is not public.
_PROXY_CUT = "upstream connect error or disconnect/reset before headers. reset reason: connection termination"

_STDOUT_FDS = (
    sr_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT,
    sr_pb2.SANDBOX_STDIO_FILE_DESCRIPTOR_STDOUT,
)


class CommandRouter:
    def __init__(self, emu: ModalEmulator) -> None:
        self.emu = emu
        self.store = emu._store

    # -- auth & lookup -------------------------------------------------------------------
    def check_auth(self, stream) -> None:
        md = stream.metadata or {}
        header = md.get("authorization", "")
        if (
            not header.startswith("Bearer ")
            or header[7:] not in self.emu._issued_router_tokens
        ):
            raise GRPCError(
                Status.UNAUTHENTICATED, "emulator: missing or unknown router JWT"
            )

    def _task(self, task_id: str, *, running: bool = True):
        sandbox_id = self.store.tasks.get(task_id)
        if sandbox_id is None:
            raise GRPCError(Status.NOT_FOUND, f"Task {task_id} not found")
        sb = self.store.sandboxes[sandbox_id]
        if running and sb.result is not None:
            raise GRPCError(Status.NOT_FOUND, f"Task {task_id} has finished")
        return sb

    def _exec(self, task_id: str, exec_id: str) -> LocalProcess:
        sb = self._task(task_id, running=False)
        proc = sb.execs.get(exec_id)
        if proc is None:
            raise GRPCError(
                Status.NOT_FOUND, f"Exec {exec_id} not found in task {task_id}"
            )
        return proc

    # -- exec ----------------------------------------------------------------------------
    async def TaskExecStart(self, req, stream):
        sb = self._task(req.task_id)
        if req.container_id:
            raise GRPCError(
                Status.UNIMPLEMENTED, "emulator: sidecar containers are not emulated"
            )
        if req.HasField("pty_info") and req.pty_info.enabled:
            raise GRPCError(
                Status.UNIMPLEMENTED, "emulator: PTY execs are not emulated"
            )
        if req.exec_id in sb.execs:  # exec_id doubles as the idempotency key
            return sr_pb2.TaskExecStartResponse()
        if not req.command_args:
            raise GRPCError(Status.INVALID_ARGUMENT, "command_args must not be empty")
        argv = list(req.command_args)
        if argv[0] == FS_TOOLS_PATH:
            # The SDK's filesystem API execs a helper binary shipped in Modal's containers;
            # the emulated container ships a Python stand-in.
            argv = [sys.executable, str(FS_TOOLS_SCRIPT), *argv[1:]]
        cwd = sb.host_path(req.workdir) if req.HasField("workdir") else sb.view
        extra_env = env_from_secret_sources(req.secret_sources)
        extra_env.update(dict(req.env))
        env = sb.process_env(extra_env)
        env["MODAL_EMULATOR_SANDBOX_ROOT"] = str(sb.view)
        env["MODAL_EMULATOR_SANDBOX_WORKDIR"] = sb.workdir or ""
        argv, spawn_cwd = sb.spawn(argv, str(cwd))
        proc = LocalProcess(id=req.exec_id, argv=argv, cwd=spawn_cwd)
        proc.exit_status_delay = self.emu.exit_status_delay
        proc.stdout.delay = proc.stderr.delay = self.emu.output_delay
        sb.touch()
        sb.execs[req.exec_id] = proc
        await proc.start(
            env,
            pipe_stdout=req.stdout_config != sr_pb2.TASK_EXEC_STDOUT_CONFIG_DEVNULL,
            pipe_stderr=req.stderr_config != sr_pb2.TASK_EXEC_STDERR_CONFIG_DEVNULL,
            timeout=req.timeout_secs
            if req.HasField("timeout_secs") and req.timeout_secs
            else None,
        )
        return sr_pb2.TaskExecStartResponse()

    async def TaskExecStdioRead(self, req, stream):
        proc = self._exec(req.task_id, req.exec_id)
        buf = proc.stdout if req.file_descriptor in _STDOUT_FDS else proc.stderr
        # A proxy in front of the router may cut a long-held response stream
        # (``cut_long_requests_after``); the SDK resumes it at the byte offset it
        # has read (``_stream_stdio_with_retries``: retryable statuses, 10 retries,
        # the budget reset by every chunk received).
        cut = self.emu.cut_long_requests_after
        loop = asyncio.get_running_loop()
        cut_at = loop.time() + cut if cut else None
        chunks = buf.chunks(req.offset)
        try:
            while True:
                nxt = asyncio.ensure_future(chunks.__anext__())
                try:
                    timeout = None if cut_at is None else max(0.0, cut_at - loop.time())
                    _, chunk = await asyncio.wait_for(nxt, timeout)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise GRPCError(Status.UNAVAILABLE, _PROXY_CUT) from None
                yield sr_pb2.TaskExecStdioReadResponse(data=chunk)
        finally:
            await chunks.aclose()

    @staticmethod
    def _exit_status(resp, proc: LocalProcess):
        if proc.exit_signal is not None:
            resp.signal = proc.exit_signal
        else:
            resp.code = proc.returncode
        return resp

    async def TaskExecWait(self, req, stream):
        # A long-poll: the SDK (``exec_wait`` in modal/sandbox/_task_command_router_client.py)
        # sends it with a 60 s timeout and retries it for ever, 1 s apart, on
        # DEADLINE_EXCEEDED/UNAVAILABLE/CANCELLED/INTERNAL/UNKNOWN, until an exit status,
        # NOT_FOUND (task gone) or the exec's own deadline. The answer comes
        # ``exit_status_delay`` after the process exited, and a proxy may cut the
        # held request first (``cut_long_requests_after``).
        proc = self._exec(req.task_id, req.exec_id)
        sb = self._task(req.task_id, running=False)
        cut = self.emu.cut_long_requests_after
        waiter = asyncio.ensure_future(proc.wait_reported())
        ended = asyncio.ensure_future(sb._done.wait())
        try:
            await asyncio.wait({waiter, ended}, timeout=cut or None, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waiter, ended):
                t.cancel()
        if proc.reported():
            return self._exit_status(sr_pb2.TaskExecWaitResponse(), proc)
        if sb.result is not None:
            raise GRPCError(Status.NOT_FOUND, f"Task {req.task_id} has finished")
        raise GRPCError(Status.UNAVAILABLE, _PROXY_CUT)

    async def TaskExecPoll(self, req, stream):
        proc = self._exec(req.task_id, req.exec_id)
        if not proc.reported():
            return sr_pb2.TaskExecPollResponse()
        return self._exit_status(sr_pb2.TaskExecPollResponse(), proc)

    async def _write_stdin(
        self, proc: LocalProcess, offset: int, data: bytes, eof: bool
    ) -> None:
        try:
            await proc.write_stdin(offset, data, eof)
        except ValueError as exc:
            raise GRPCError(Status.OUT_OF_RANGE, str(exc)) from None
        except BrokenPipeError:
            # What the SDK expects when the process has gone: ConflictError.
            raise GRPCError(
                Status.FAILED_PRECONDITION, f"Exec {proc.id} no longer accepts stdin"
            ) from None

    async def TaskExecStdinWrite(self, req, stream):
        proc = self._exec(req.task_id, req.exec_id)
        await self._write_stdin(proc, req.offset, req.data, req.eof)
        return sr_pb2.TaskExecStdinWriteResponse()

    async def TaskExecStdinStatus(self, req, stream):
        proc = self._exec(req.task_id, req.exec_id)
        return sr_pb2.TaskExecStdinStatusResponse(
            num_bytes_written=proc.stdin_offset, closed=proc.stdin_closed
        )

    async def TaskExecStdinWriteStream(
        self, stream
    ):  # client-streaming: Start, Data..., End
        first = await stream.recv_message()
        if first is None or first.WhichOneof("payload") != "start":
            raise GRPCError(Status.INVALID_ARGUMENT, "first message must be 'start'")
        proc = self._exec(first.start.task_id, first.start.exec_id)
        offset = first.start.offset
        async for msg in stream:
            kind = msg.WhichOneof("payload")
            if kind == "data":
                await self._write_stdin(proc, offset, msg.data, False)
                offset += len(msg.data)
            elif kind == "end":
                await self._write_stdin(proc, offset, b"", True)
                break
        await stream.send_message(sr_pb2.TaskExecStdinWriteStreamResponse())

    # -- the sandbox's own entrypoint stdio --------------------------------------------------
    async def SandboxStdioReadV2(self, req, stream):
        sb = self._task(req.task_id, running=False)
        if sb.entrypoint is None:
            return
        buf = (
            sb.entrypoint.stdout
            if req.file_descriptor in _STDOUT_FDS
            else sb.entrypoint.stderr
        )
        async for start, chunk in buf.chunks(req.offset):
            yield sr_pb2.SandboxStdioReadV2Response(data=chunk, starting_offset=start)

    async def SandboxStdinWriteV2(self, req, stream):
        sb = self._task(req.task_id)
        if sb.entrypoint is None:
            raise GRPCError(
                Status.FAILED_PRECONDITION, "sandbox has no entrypoint process"
            )
        await self._write_stdin(sb.entrypoint, req.offset, req.data, req.eof)
        return sr_pb2.SandboxStdinWriteV2Response()

    async def SandboxWaitUntilReady(self, req, stream):
        self._task(req.task_id)
        return sr_pb2.SandboxWaitUntilReadyTcrResponse()

    # -- snapshots -----------------------------------------------------------------------
    async def TaskSnapshotFilesystem(self, req, stream):
        # Sandbox.snapshot_filesystem() on a V2 sandbox (modal/sandbox/_common.py:
        # snapshot_filesystem_via_tcr): TaskSnapshotFilesystemRequest{task_id, snapshot_id (a
        # uuid4 per call), ttl_seconds, container_id} -> TaskSnapshotFilesystemResponse{image_id};
        # the SDK wraps the id as a hydrated Image. The control plane's SandboxSnapshotFs is
        # the V1 path (_impl_v1.py, legacy), not emulated. A retried call (same snapshot_id)
        # gets the same image.
        sb = self._task(req.task_id)
        done = self.store.snapshots_by_key.get((req.task_id, req.snapshot_id)) if req.snapshot_id else None
        if done is not None and done in self.store.images:
            return sr_pb2.TaskSnapshotFilesystemResponse(image_id=done)
        if req.container_id:
            raise GRPCError(
                Status.UNIMPLEMENTED, "emulator: sidecar containers are not emulated"
            )
        rec = await self.store.snapshot(sb)
        # snapshot_filesystem(ttl=...) in modal/sandbox/_sandbox.py: kept 30 days by default, -1 = for ever.
        rec.ttl_seconds = req.ttl_seconds
        if req.snapshot_id:
            self.store.snapshots_by_key[(req.task_id, req.snapshot_id)] = rec.id
        return sr_pb2.TaskSnapshotFilesystemResponse(image_id=rec.id)

    async def TaskMountDirectory(self, req, stream):
        raise GRPCError(
            Status.UNIMPLEMENTED, "emulator: mounting images is not emulated"
        )

    async def TaskUnmountDirectory(self, req, stream):
        raise GRPCError(
            Status.UNIMPLEMENTED, "emulator: mounting images is not emulated"
        )
