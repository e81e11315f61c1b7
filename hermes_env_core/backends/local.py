"""The local backend: commands run as child processes of this one.

Each command gets a new session and, where one can be made, its own cgroup, so
a timeout ends everything it started; the child environment has secrets
filtered out.
"""

from __future__ import annotations

import fnmatch
import os
import re
import resource
import select
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import IO, Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from ..environment.base import BaseEnvironment
from ..environment.channel import ChannelStream, PipeStream
from ..environment.handles import ProcessHandle
from ..environment.server import BOOT_ARGV as SERVER_ARGV
from ..environment.options import EnvironmentConfig, channel_default
from ..environment.result import Usage
from ..environment.session import WrappedCommand
from ..environment.target import RunRequest
from ..errors import EnvironmentUnavailable
from ._local_memory import MemoryCgroup
from ._local_tree import CommandCgroup, ProcessTree, cgroup_pool, stop_all, wait_dead

__all__ = [
    "LocalConfig", "LocalEnvironment", "ProcessTree", "SECRET_PATTERNS", "carries_url_password", "feed_stdin",
    "filter_environment", "start_bash",
]

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
    "PGPASSWORD", "MYSQL_PWD", "SECRET_KEY", "PRIVATE_KEY", "*_CONNECTION_STRING",
)

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Where a value may carry a URL with credentials: a scheme, then "://".
_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_URL_END = re.compile(r"[\s,;'\"<>]")

_SCRIPT_ARG_LIMIT = 100_000  # one argv string may not exceed 128 KiB on Linux


def carries_url_password(value: str) -> bool:
    """True when ``value`` holds a URL whose user part has a password (``scheme://u:p@host``)."""
    for start in _URL_START.finditer(value):
        end = _URL_END.search(value, start.end())
        url = value[start.start() : end.start() if end else len(value)]
        try:
            password = urlsplit(url).password
        except ValueError:  # e.g. an unbalanced "[" in the host: not a URL we can read
            continue
        if password:
            return True
    return False


def filter_environment(
    env: Mapping[str, str], *, passthrough: tuple[str, ...] = (), extra_blocked: tuple[str, ...] = ()
) -> dict[str, str]:
    """``env`` without secret-looking names or values, except names matching ``passthrough``.

    A value is secret-looking when it holds a URL with a password in it
    (``DATABASE_URL=postgres://user:pass@host/db``).
    """
    blocked = tuple(p.upper() for p in SECRET_PATTERNS + extra_blocked)
    allowed = tuple(p.upper() for p in passthrough)
    out: dict[str, str] = {}
    for name, value in env.items():
        up = name.upper()
        if any(fnmatch.fnmatchcase(up, p) for p in allowed) or not (
            any(fnmatch.fnmatchcase(up, p) for p in blocked) or carries_url_password(value)
        ):
            out[name] = value
    return out


class LocalConfig(EnvironmentConfig):
    """Options of the local backend."""

    env_passthrough: tuple[str, ...] = Field((), description="Secret-looking variables to pass anyway (globs).")
    env_blocklist: tuple[str, ...] = Field((), description="More variable names to keep out (globs).")
    inherit_env: bool = Field(True, description="Start from this process's environment.")
    bash: str = Field("bash", description="The bash executable.")
    cgroup: bool = Field(
        True,
        description="Run each command in a cgroup of its own when one can be made (cgroup v2), so that a "
        "timeout, cancel or close stops every process it started.",
    )
    login: bool = Field(
        False,
        description="Start the session as a login shell: the profile (/etc/profile, ~/.profile) then forms "
        "PATH and the environment, replacing the caller's.",
    )
    channel: bool = Field(
        default_factory=lambda: channel_default(True),
        description="Run commands in the session server, a resident bash child (HERMES_ENV_CHANNEL=0: one bash "
        "per command, the state restored each time).",
    )

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _NAME_RE.match(name):
                raise ValueError(f"local: env key {name!r} is not a valid variable name (letters, digits, _; not first a digit)")
        return v


class _CommandPopen(subprocess.Popen):  # type: ignore[type-arg]
    """A command's bash; terminate and kill reach every process it started.

    Those are the members of its cgroup (when one could be made) and of its
    process tree and group as seen before each signal. ``wait()`` returns once
    bash has exited and, after a kill, once the rest is gone too.

    It reaps bash itself with ``wait4``, so the kernel's accounting of the
    command's tree (every process bash waited for) comes back as ``usage``.
    """

    usage: Usage | None = None
    #: this process's own peak RSS (bytes) when bash was started
    spawner_peak = 0
    cgroup: CommandCgroup | None = None
    memory: MemoryCgroup | None = None
    tree: ProcessTree | None = None
    stopping = False

    def _stop(self, sig: int) -> None:
        self.stopping = True
        if self.tree is None:
            self.tree = ProcessTree(self.pid, reaped=self.returncode is not None)
        stop_all(self.cgroup, self.tree, sig)

    def terminate(self) -> None:
        self._stop(signal.SIGTERM)

    def kill(self) -> None:
        self._stop(signal.SIGKILL)

    def tree_alive(self) -> bool:
        if self.cgroup is not None and self.cgroup.populated():
            return True
        if self.tree is None:
            return self.poll() is None
        self.tree.refresh()
        return bool(self.tree.alive())

    def _reap4(self, flags: int) -> None:
        try:
            pid, status, ru = os.wait4(self.pid, flags)
        except ChildProcessError:
            if self.returncode is None:
                self.returncode = 0  # reaped elsewhere; as Popen itself reports it
            return
        except InterruptedError:
            return
        if pid:
            # A child starts out with the high-water mark of the process it
            # was forked from (the kernel keeps it across exec): a figure no
            # higher than ours then says nothing about the command.
            # higher than ours then says nothing about the command. Its own
            # memory cgroup, where one could be made, counts just the command.
            peak = ru.ru_maxrss * 1024  # kilobytes on Linux
            measured = self.memory.peak() if self.memory is not None else None
            self.usage = Usage(
                cpu_user_s=ru.ru_utime,
                cpu_system_s=ru.ru_stime,
                max_rss_bytes=measured if measured is not None else peak if peak > self.spawner_peak else None,
                oom_killed=_oom_killed(self.memory),
            )
            self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap4(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait_bash(timeout)
        if self.stopping and self.tree is not None:
            wait_dead(self.tree.alive(), 5.0)
        cg, self.cgroup = self.cgroup, None
        if cg is not None:
            cg.release(keep_alive=not self.stopping)
        mem, self.memory = self.memory, None
        if mem is not None:
            mem.release()
        return code

    def _wait_bash(self, timeout: float | None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is None:
            while self.returncode is None:
                self._reap4(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._reap4(os.WNOHANG)
            pidfd = -1
        try:
            while self.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                if pidfd >= 0:
                    select.select([pidfd], [], [], left)
                else:
                    time.sleep(min(left, 0.01))
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        assert self.returncode is not None
        return self.returncode


class LocalEnvironment(BaseEnvironment):
    """Runs commands on this machine."""

    name = "local"
    #: A detached background process needs nothing to outlive close: this machine stays.
    background_options: dict[str, object] = {}
    stdin_mode = "pipe"
    shares_host_filesystem = True
    state_dir_private = True  # mkdtemp: 0700, random name
    named_sessions = True  # a session server that outlives this process (environment.named)
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
        self._server_groups: tuple[Any, ...] = ()
        self._server_procs: list[subprocess.Popen[bytes]] = []
        self._oom_before: int | None = None
        # An environment never closed still leaves nothing behind when it is collected or at exit.
        self._dir_finalizer = weakref.finalize(self, _forget, self._dir, self._server_procs)

    @property
    def bash_path(self) -> str:
        """The bash every process of the session runs."""
        return self._bash

    @property
    def process_environment(self) -> dict[str, str]:
        """The environment a process of the session starts with (a copy)."""
        return dict(self._env)

    def _state_dir(self) -> str:
        return self._dir

    def _server_login(self) -> bool:
        # By default the caller's environment, PATH and an activated virtualenv included, as it is.
        return bool(self.config.login)  # type: ignore[attr-defined]

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        cwd = self.config.cwd if self.config.cwd and os.path.isdir(self.config.cwd) else None
        request = RunRequest(script=script, login=login, stdin=stdin_data, timeout=timeout)
        return start_bash(request, env=self._env, cwd=cwd, bash=self._bash, cgroup=self.config.cgroup)  # type: ignore[attr-defined]

    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        # The resident bash: a child of this process in its own session, like every command.
        args = [self._bash, *argv[1:]]
        if tuple(argv) == SERVER_ARGV:
            # The session server gets a cgroup of its own (where one can be made): a command's
            # setsid descendants stay in it, and its memory is counted per command.
            self._server_groups = tuple(
                g for g in (_new_cgroup() if self.config.cgroup else None, MemoryCgroup.make()) if g is not None  # type: ignore[attr-defined]
            )
            join = "".join(f"builtin echo 0 >{shlex.quote(g.procs)} 2>/dev/null; " for g in self._server_groups)
            args = [self._bash, "-c", join + argv[2]]
        try:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=self._env,
                start_new_session=True,
                cwd=self.config.cwd if self.config.cwd and os.path.isdir(self.config.cwd) else None,
            )
        except OSError as exc:
            raise EnvironmentUnavailable(f"local: cannot start {self._bash}: {exc}") from exc
        assert proc.stdin is not None and proc.stdout is not None
        _widen_pipe(proc.stdout.fileno())

        server = tuple(argv) == SERVER_ARGV

        def stop() -> None:
            try:
                if server:
                    # The session's shell only: its background jobs outlive it, as a shell's do.
                    # (Popen.kill: once reaped by poll(), the pid may be another process's.)
                    proc.kill()
                else:
                    os.killpg(proc.pid, signal.SIGKILL)  # the server and its relay
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()

        if server:
            self._server_procs.append(proc)

        return PipeStream(proc.stdin, proc.stdout, on_close=stop, exited=lambda: proc.poll() is not None)

    def _kill_tree(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        if graceful:
            handle.terminate()  # type: ignore[attr-defined]
        else:
            handle.kill()

    def _tree_alive(self, handle: ProcessHandle, wrapped: WrappedCommand) -> bool | None:
        return handle.tree_alive() if isinstance(handle, _CommandPopen) else None

    def _command_begin(self) -> None:
        for g in self._server_groups:
            if isinstance(g, MemoryCgroup):
                g.reset_peak()
                self._oom_before = g.oom_kills()

    def _explain_lost(self, started: float) -> tuple[int, str] | None:
        # The session's shell is a child of ours: its own exit status says what ended it.
        proc = self._server_procs[-1] if self._server_procs else None
        if proc is None:
            return None
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None
        if code < 0:
            return 128 - code, f"the session's shell was killed by signal {-code}"
        return None

    def _command_usage(self, exit_code: int | None, started: float) -> Usage | None:
        for g in self._server_groups:
            if isinstance(g, MemoryCgroup):
                kills = g.oom_kills()
                return Usage(
                    max_rss_bytes=g.peak(),
                    oom_killed=None if kills is None else kills > (self._oom_before or 0),
                )
        return None

    def cleanup(self) -> None:
        self._dir_finalizer()
        groups, self._server_groups = self._server_groups, ()
        for g in groups:
            if isinstance(g, MemoryCgroup):
                g.release()
            else:
                g.release(keep_alive=False)


def _forget(directory: str, servers: list[subprocess.Popen[bytes]]) -> None:
    """An environment never closed: its session servers go, and its private directory."""
    for proc in servers:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
    shutil.rmtree(directory, True)


def start_bash(
    request: RunRequest,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    bash: str = "bash",
    cgroup: bool = True,
) -> ProcessHandle:
    """Start ``bash -c request.script`` on this machine, as the local backend does.

    For a ``Target`` whose commands run here (or behind a local command such
    as a container runtime's CLI): output merged on ``stdout``; ``stdin`` fed
    from a thread and closed (no stdin: end of input at once); a script past
    the argv limit read from a pipe; bash in a new session and, where one can
    be made, its own cgroup. The handle's ``terminate()`` and ``kill()`` reach
    the whole tree (``setsid`` children included), ``tree_alive()`` tells
    whether any of it is left, ``wait()`` reaps it and fills ``usage``.
    ``env`` defaults to this process's environment with secrets filtered out
    (``filter_environment``). ``cgroup=False``: no cgroup even where one can
    be made (the tree is then found through psutil). Raises ``EnvironmentUnavailable`` when bash
    cannot be started.
    """
    if env is None:
        env = filter_environment(os.environ)
    found = bash if os.path.isabs(bash) and os.access(bash, os.X_OK) else shutil.which(bash, path=env.get("PATH"))
    if found is None:
        raise EnvironmentUnavailable(f"local: cannot start {bash}: not an executable file (nor on PATH)")
    args = [found, "-l"] if request.login else [found]
    script = request.script
    group = _new_cgroup() if cgroup else None
    memory = MemoryCgroup.make()
    # bash joins its cgroups before it runs anything of the command (on the
    # script's first line, so that line numbers stay those of the script).
    join = "".join(
        f"builtin echo 0 >{shlex.quote(c.procs)} 2>/dev/null; " for c in (group, memory) if c is not None
    )
    pass_fds: tuple[int, ...] = ()
    script_r = script_w = -1
    if len(script) > _SCRIPT_ARG_LIMIT:
        # Too long for one argv string: bash reads it from a pipe instead.
        script_r, script_w = os.pipe()
        pass_fds = (script_r,)
        args += ["-c", f"{join}builtin source /dev/fd/{script_r}", "bash"]
    else:
        args += ["-c", join + script, "bash"]
    spawner_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        proc = _CommandPopen(
            args,
            stdin=subprocess.PIPE if request.stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env if isinstance(env, dict) else dict(env),
            start_new_session=True,
            pass_fds=pass_fds,
            cwd=cwd,
        )
    except OSError as exc:
        if group is not None:
            group.release(keep_alive=False)
        if memory is not None:
            memory.release()
        if script_w >= 0:
            os.close(script_w)
        raise EnvironmentUnavailable(f"local: cannot start {bash}: {exc}") from exc
    finally:
        if script_r >= 0:
            os.close(script_r)
    proc.cgroup = group
    proc.memory = memory
    proc.spawner_peak = spawner_peak
    if script_w >= 0:
        feed_stdin(os.fdopen(script_w, "wb"), script.encode("utf-8", "surrogateescape"))
    if proc.stdout is not None:
        _widen_pipe(proc.stdout.fileno())
    if request.stdin is not None:
        feed_stdin(proc.stdin, request.stdin)
    return proc


def _oom_killed(memory: MemoryCgroup | None) -> bool | None:
    kills = memory.oom_kills() if memory is not None else None
    return None if kills is None else kills > 0


def _new_cgroup() -> CommandCgroup | None:
    pool = cgroup_pool()
    if pool is None:
        return None
    try:
        return CommandCgroup(*pool)
    except OSError:
        return None


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
