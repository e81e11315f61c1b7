"""The local backend: commands run as child processes of this one.

Each command gets a new session (its own process group), so a timeout ends the
whole tree; the child environment has secrets filtered out.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from typing import IO

from pydantic import Field

from ..environment.base import BaseEnvironment
from ..environment.handles import ProcessHandle
from ..environment.options import EnvironmentConfig
from ..environment.session import WrappedCommand
from ..errors import EnvironmentUnavailable

__all__ = ["LocalConfig", "LocalEnvironment", "SECRET_PATTERNS", "feed_stdin", "filter_environment"]

#: Variable names (globs, matched case-insensitively) kept out of commands.
SECRET_PATTERNS: tuple[str, ...] = (
    "*_API_KEY", "*_APIKEY", "*_TOKEN", "*_SECRET", "*_SECRET_KEY", "*_PASSWORD", "*_PASSWD",
    "*_ACCESS_KEY", "*_PRIVATE_KEY", "*_CREDENTIALS", "API_KEY", "TOKEN", "SECRET", "PASSWORD",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AZURE_CLIENT_SECRET",
    "GOOGLE_APPLICATION_CREDENTIALS", "GH_TOKEN", "GITHUB_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
    "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "DAYTONA_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY",
    "OPENROUTER_API_KEY", "GROQ_API_KEY", "MISTRAL_API_KEY", "COHERE_API_KEY", "TOGETHER_API_KEY",
    "DEEPSEEK_API_KEY", "XAI_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "NPM_TOKEN",
    "PYPI_TOKEN", "TWINE_PASSWORD", "DOCKER_AUTH_CONFIG", "SSH_AUTH_SOCK",
)


def filter_environment(
    env: Mapping[str, str], *, passthrough: tuple[str, ...] = (), extra_blocked: tuple[str, ...] = ()
) -> dict[str, str]:
    """``env`` without secret-looking names, except those matching ``passthrough``."""
    blocked = tuple(p.upper() for p in SECRET_PATTERNS + extra_blocked)
    allowed = tuple(p.upper() for p in passthrough)
    out: dict[str, str] = {}
    for name, value in env.items():
        up = name.upper()
        if any(fnmatch.fnmatchcase(up, p) for p in allowed) or not any(
            fnmatch.fnmatchcase(up, p) for p in blocked
        ):
            out[name] = value
    return out


class LocalConfig(EnvironmentConfig):
    """Options of the local backend."""

    env_passthrough: tuple[str, ...] = Field((), description="Secret-looking variables to pass anyway (globs).")
    env_blocklist: tuple[str, ...] = Field((), description="More variable names to keep out (globs).")
    inherit_env: bool = Field(True, description="Start from this process's environment.")
    bash: str = Field("bash", description="The bash executable.")


class _GroupPopen(subprocess.Popen):  # type: ignore[type-arg]
    """A Popen whose terminate and kill reach its whole process group."""

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)


class LocalEnvironment(BaseEnvironment):
    """Runs commands on this machine."""

    name = "local"
    stdin_mode = "pipe"
    shares_host_filesystem = True
    state_dir_private = True  # mkdtemp: 0700, random name
    config_model = LocalConfig

    def __init__(self, config: LocalConfig | None = None, **options: object) -> None:
        super().__init__(config, **options)
        cfg: LocalConfig = self.config  # type: ignore[assignment]
        bash = shutil.which(cfg.bash)
        if bash is None:
            raise EnvironmentUnavailable(f"local: bash not found (looked for {cfg.bash!r} on PATH)")
        self._bash = bash
        base = dict(os.environ) if cfg.inherit_env else {"PATH": os.defpath}
        env = filter_environment(base, passthrough=cfg.env_passthrough, extra_blocked=cfg.env_blocklist)
        env.update(cfg.env)
        self._env = env
        self._dir = tempfile.mkdtemp(prefix="hermes-env-", dir=_fast_tmp())  # 0700

    def _state_dir(self) -> str:
        return self._dir

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        args = [self._bash, "-l"] if login else [self._bash]
        args += ["-c", script, "bash"]
        try:
            proc = _GroupPopen(
                args,
                stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
                cwd=self.config.cwd if self.config.cwd and os.path.isdir(self.config.cwd) else None,
            )
        except OSError as exc:
            raise EnvironmentUnavailable(f"local: cannot start {self._bash}: {exc}") from exc
        if proc.stdout is not None:
            _widen_pipe(proc.stdout.fileno())
        if stdin_data is not None:
            feed_stdin(proc.stdin, stdin_data)
        return proc

    def _kill_tree(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        if graceful:
            handle.terminate()  # type: ignore[attr-defined]
        else:
            handle.kill()

    def cleanup(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def _widen_pipe(fd: int) -> None:
    """A 1 MiB pipe: a command writing a lot wakes us far less often."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (OSError, ImportError):
        pass  # not Linux, or over /proc/sys/fs/pipe-max-size: the default pipe works


def _fast_tmp() -> str | None:
    """A memory-backed temp dir when there is one: state files are written per command."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return None


def feed_stdin(pipe: IO[bytes] | None, data: bytes) -> None:
    """Write stdin from a thread so a command that does not read cannot block us."""
    if pipe is None:
        return

    def run() -> None:
        try:
            pipe.write(data)
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    if len(data) <= 16384:
        run()  # fits in the pipe buffer: no thread needed
    else:
        threading.Thread(target=run, name="hermes-env-stdin", daemon=True).start()
