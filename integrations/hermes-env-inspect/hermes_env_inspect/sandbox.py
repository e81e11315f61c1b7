"""The ``hermes`` sandbox: inspect_ai's ``SandboxEnvironment`` on any hermes-env backend.

One hermes-env environment per sample, driven through ``hermes_env_core.aio``;
every call is one ``execute()`` of a script from ``scripts``. Nothing here
knows a backend: the public API is all it uses.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import shlex
import shutil
import sys
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecRemoteAwaitableOptions,
    ExecRemoteProcess,
    ExecRemoteStreamingOptions,
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from pydantic import BaseModel

from hermes_env_core import EnvironmentUnavailable
from hermes_env_core import ExecResult as HermesResult
from hermes_env_core.aio import AsyncEnvironment, ExecStream, run_in_thread

from . import scripts
from .config import HermesSandboxConfig, as_config, resolve

__all__ = ["HermesSandboxEnvironment"]

log = logging.getLogger(__name__)

#: Data above this goes to the target in chunks of this size (bash reads a
#: large heredoc in time that grows faster than its size).
CHUNK = 1 << 20


def output_floor() -> int:
    """The ``max_output_bytes`` a sandbox needs: a whole file, or both exec streams, base64-encoded."""
    biggest = max(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE, 2 * SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE)
    return biggest * 4 // 3 + biggest // 30 + (64 << 10)


def _os_error(message: str, file: str) -> OSError:
    for needle, cls, code in (
        ("Permission denied", PermissionError, errno.EACCES),
        ("Operation not permitted", PermissionError, errno.EPERM),
        ("Is a directory", IsADirectoryError, errno.EISDIR),
        ("Not a directory", NotADirectoryError, errno.ENOTDIR),
        ("No such file", FileNotFoundError, errno.ENOENT),
        ("Read-only file system", OSError, errno.EROFS),
        ("No space left", OSError, errno.ENOSPC),
    ):
        if needle in message:
            return cls(code, needle, file)
    return OSError(errno.EIO, message.strip() or "write failed", file)


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


@sandboxenv(name="hermes")
class HermesSandboxEnvironment(SandboxEnvironment):
    """A sample's sandbox: one hermes-env environment, its working directory and a private control directory."""

    _by_task: dict[str, list[HermesSandboxEnvironment]] = {}

    def __init__(
        self,
        env: AsyncEnvironment,
        config: HermesSandboxConfig,
        *,
        backend: str,
        ctl: str,
        workdir: str,
        owns_workdir: bool,
        task_name: str,
    ) -> None:
        super().__init__()
        self.env = env
        self.config = config
        self.backend = backend
        self.ctl = ctl
        self.workdir = workdir
        self._owns_workdir = owns_workdir
        self._task_name = task_name
        self._staged = 0

    # -- lifecycle -----------------------------------------------------------------
    @classmethod
    def config_files(cls) -> list[str]:
        return ["hermes-env.toml"]

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return HermesSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        # Resolve once up front: a bad backend name or option fails the task, not each sample.
        cfg = as_config(config)
        await run_in_thread(resolve, cfg, output_floor=output_floor())

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        sandbox = await cls.create(as_config(config), task_name=task_name)
        return {"default": sandbox}

    @classmethod
    async def create(cls, config: HermesSandboxConfig, *, task_name: str = "") -> HermesSandboxEnvironment:
        """Start an environment for ``config`` and prepare it as a sandbox (also usable outside an eval)."""

        def start() -> tuple[str, Any]:
            factory, resolved = resolve(config, output_floor=output_floor())
            return resolved.backend, factory.create_resolved(resolved)

        try:
            backend, sync_env = await run_in_thread(start)
        except EnvironmentUnavailable as exc:
            raise SandboxUnavailableError(f"hermes sandbox: the environment could not start: {exc}") from exc
        env = AsyncEnvironment(sync_env)
        try:
            mode = config.workdir or ("sample" if sync_env.shares_host_filesystem else "session")
            tag = scripts.new_tag()
            r = await env.execute(scripts.init_script(tag, make_workdir=mode == "sample"))
            fields = scripts.parse_answer(tag, r.output).fields
            if len(fields) < 3:
                raise scripts.ProtocolError(f"bad init answer: {fields!r}")
            ctl, made, start_dir = fields[0], fields[1], " ".join(fields[2:])
            workdir = made if mode == "sample" else start_dir if mode == "session" else mode
        except BaseException:
            await env.close()
            raise
        sandbox = cls(
            env, config, backend=backend, ctl=ctl, workdir=workdir, owns_workdir=mode == "sample", task_name=task_name
        )
        cls._by_task.setdefault(task_name, []).append(sandbox)
        return sandbox

    async def close(self) -> None:
        """Remove the sample's directories and close the environment (idempotent)."""
        live = self._by_task.get(self._task_name, [])
        if self in live:
            live.remove(self)
        if self.env.closed:
            return
        doomed = [self.ctl] + ([self.workdir] if self._owns_workdir else [])
        try:
            await self.env.execute(f"command rm -rf -- {shlex.join(doomed)}", timeout=60)
        except Exception as exc:  # the target may be gone already; closing still releases it
            log.debug("hermes sandbox: removing %s failed: %s", doomed, exc)
        await self.env.close()

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for sandbox in environments.values():
            if isinstance(sandbox, HermesSandboxEnvironment):
                await sandbox.close()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        # Samples clean up after themselves; this closes what an interrupted run left behind.
        left = cls._by_task.pop(task_name, [])
        if cleanup:
            for sandbox in left:
                await sandbox.close()

    # -- running scripts -------------------------------------------------------------
    async def _run(self, script: str, *, stdin: bytes | None = None, timeout: float | None = None) -> HermesResult:
        try:
            return await self.env.execute(script, stdin=stdin, timeout=timeout)
        except EnvironmentUnavailable as exc:
            raise SandboxUnavailableError(f"hermes sandbox ({self.backend}): {exc}") from exc

    async def _stage(self, data: bytes) -> str:
        """Copy ``data`` into a file in the control directory, in chunks; returns its path."""
        self._staged += 1
        dest = f"{self.ctl}/in.{self._staged}"
        for at in range(0, max(len(data), 1), CHUNK):
            chunk = base64.encodebytes(data[at : at + CHUNK])
            r = await self._run(scripts.stage_script(dest, append=at > 0), stdin=chunk)
            if r.exit_code != 0:
                raise OSError(errno.EIO, f"hermes sandbox: staging data failed: {r.output.strip()}", dest)
        return dest

    # -- the provider interface ------------------------------------------------------
    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        if isinstance(cmd, str) or not all(isinstance(a, str) for a in cmd):
            raise TypeError(f"exec: cmd must be a list of strings, got {cmd!r}")
        data = input.encode("utf-8") if isinstance(input, str) else input
        staged = await self._stage(data) if data is not None and len(data) > CHUNK else None
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        tag = scripts.new_tag()
        script = scripts.exec_script(
            tag,
            self.ctl,
            cmd,
            cwd=scripts.resolve_path(self.workdir, cwd or "."),
            env=env,
            user=user,
            limit=limit + 1,
            stdin_file=staged,
        )
        r = await self._run(script, stdin=None if staged else data, timeout=timeout)
        if r.timed_out:
            raise TimeoutError(f"command timed out after {timeout}s: {shlex.join(cmd)}")
        if r.interrupted:
            raise SandboxUnavailableError(f"hermes sandbox ({self.backend}): the command was interrupted ({r.notes})")
        answer = scripts.parse_exec(tag, r.output)
        if answer.kind == "nouser":
            why = "the sandbox does not run as root" if answer.detail == "not-root" else "runuser is not installed"
            raise SandboxUserUnsupportedError(f"cannot run as user {user!r}: {why}")
        if answer.kind == "exec" and answer.detail == "126":
            raise PermissionError(errno.EACCES, f"permission denied executing {cmd[0]!r}: {_text(answer.stderr).strip()}")
        for size, kept in ((answer.stdout_bytes, answer.stdout), (answer.stderr_bytes, answer.stderr)):
            if size > limit:
                raise OutputLimitExceededError(
                    SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, truncated_output=_text(kept[-limit:])
                )
        return ExecResult(
            success=answer.returncode == 0,
            returncode=answer.returncode,
            stdout=_text(answer.stdout),
            stderr=_text(answer.stderr),
        )

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode("utf-8") if isinstance(contents, str) else bytes(contents)
        path = scripts.resolve_path(self.workdir, file)
        staged = await self._stage(data) if len(data) > CHUNK else None
        tag = scripts.new_tag()
        r = await self._run(scripts.write_script(tag, path, source=staged), stdin=None if staged else data)
        if r.timed_out:
            raise TimeoutError(f"writing {file} timed out")
        answer = scripts.parse_answer(tag, r.output)
        kind = answer.fields[0]
        if kind == "ok":
            return
        if kind == "isdir":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        raise _os_error(" ".join(answer.fields[1:]) + answer.rest, file)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        path = scripts.resolve_path(self.workdir, file)
        tag = scripts.new_tag()
        r = await self._run(scripts.read_script(tag, path, limit=limit))
        if r.timed_out:
            raise TimeoutError(f"reading {file} timed out")
        if r.truncated:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        answer = scripts.parse_answer(tag, r.output)
        kind = answer.fields[0]
        if kind == "isdir":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        if kind == "noent":
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", file)
        if kind == "perm":
            raise PermissionError(errno.EACCES, "Permission denied", file)
        if kind == "limit":
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        data, _ = scripts.decode_block(answer.rest)
        if len(data) > limit:  # grew between the size check and the read
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        return data.decode("utf-8") if text else data

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """A shell in this sample's sandbox: ``docker exec`` into its container, else ``hermes-env shell``."""
        container = getattr(self.env.sync, "container_id", None)
        if isinstance(container, str) and container:
            argv = ["docker", "exec", "-it", "--workdir", self.workdir]
            if user is not None:
                argv += ["--user", user]
            argv += [container, "bash", "-l"]
            prefix = ""
            host = getattr(self.env.sync.config, "docker_host", None)
            if host:
                prefix = f"DOCKER_HOST={shlex.quote(host)} "
            return SandboxConnection(type="hermes", command=prefix + shlex.join(argv), container=container)
        if user is not None:
            raise NotImplementedError(
                f"hermes sandbox: a connection as user {user!r} is only offered on docker (backend {self.backend!r})"
            )
        # this interpreter's hermes-env, whether or not its bin directory is on PATH
        found = shutil.which("hermes-env")
        argv = [found] if found else [sys.executable, "-m", "hermes_env_core.cli"]
        argv += ["shell", "--env", self.backend]
        if self.config.config_file:
            argv += ["--config-file", self.config.config_file]
        for key, value in self.config.options.items():
            text = value if isinstance(value, str) else json.dumps(value)
            argv += ["-o", f"{key}={text}"]
        argv += ["--cwd", self.workdir]
        return SandboxConnection(type="hermes", command=shlex.join(argv))

    @overload
    async def exec_remote(
        self, cmd: list[str], options: ExecRemoteStreamingOptions | None = None, *, stream: Literal[True] = True
    ) -> ExecRemoteProcess: ...

    @overload
    async def exec_remote(
        self, cmd: list[str], options: ExecRemoteAwaitableOptions | None = None, *, stream: Literal[False]
    ) -> ExecResult[str]: ...

    async def exec_remote(
        self,
        cmd: list[str],
        options: ExecRemoteStreamingOptions | ExecRemoteAwaitableOptions | None = None,
        *,
        stream: bool = True,
    ) -> ExecRemoteProcess | ExecResult[str]:
        """Streams stdout live through the session (stderr arrives when the command ends).

        ``stdin_open=True`` (writing stdin while it runs) goes through inspect's
        own implementation, which installs its tools in the sandbox.
        """
        from .remote import HermesRemoteProcess, run_awaitable

        if isinstance(options, ExecRemoteStreamingOptions) and options.stdin_open:
            return await super().exec_remote(cmd, options, stream=True)
        if stream:
            return await HermesRemoteProcess.launch(self, cmd, options or ExecRemoteStreamingOptions())
        if not isinstance(options, ExecRemoteAwaitableOptions):
            common = options or ExecRemoteStreamingOptions()
            options = ExecRemoteAwaitableOptions(
                input=common.input, cwd=common.cwd, env=common.env, user=common.user
            )
        return await run_awaitable(self, cmd, options)

    # used by remote.py
    async def _remote_stream(self, cmd: list[str], options: Any, tag: str) -> ExecStream:
        data = options.input.encode("utf-8") if isinstance(options.input, str) else options.input
        staged = await self._stage(data) if data is not None and len(data) > CHUNK else None
        script = scripts.stream_script(
            tag,
            self.ctl,
            cmd,
            cwd=scripts.resolve_path(self.workdir, options.cwd or "."),
            env=options.env,
            user=options.user,
            stdin_file=staged,
        )
        return self.env.stream(script, stdin=None if staged else data)
