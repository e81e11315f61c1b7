"""Real local processes behind ``/process/execute`` and the session API.

Every command is a real shell process in its own process group, so a
timeout or a sandbox stop kills the whole tree (``os.killpg``), as the daemon
does.  Nothing here sleeps to wait: completion is observed through pipes
(``communicate`` / a reader thread on the session shell's stdout).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# Grace between SIGTERM and SIGKILL when a command times out or its sandbox stops.
TERMINATE_GRACE_S = 0.5


def kill_group(proc: subprocess.Popen, grace: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM the process group, then SIGKILL it if the leader outlives ``grace``."""
    if proc.poll() is not None:
        # The leader is gone; children may still hold the group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class ExecOutcome:
    exit_code: int
    output: str
    timed_out: bool


class ProcessTable:
    """The live processes of one sandbox, so stop/delete/close can kill them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
            self._procs.clear()
        for proc in procs:
            kill_group(proc, grace=0.2)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def __len__(self) -> int:
        with self._lock:
            return len(self._procs)


def go_exit_code(returncode: int | None) -> int:
    """``ProcessState.ExitCode()`` as Go reports it: -1 for a process ended by a signal."""
    if returncode is None or returncode < 0:
        return -1
    return returncode


def run_command(
    command: str,
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    table: ProcessTable,
    shell: str,
) -> ExecOutcome:
    """``shell`` with ``command`` written to its stdin, output merged, killed as a group at ``timeout``.

    As the daemon's ``buildExecCmd`` (apps/daemon/pkg/toolbox/process/execute_linux.go):
    the shell gets no arguments, reads the command from stdin (which then ends),
    runs in its own process group (Setpgid) and is killed as a group on timeout.
    The exit code is Go's ``ExitCode()``: -1 when a signal ended the shell.
    """
    proc = subprocess.Popen(
        [shell],
        cwd=str(cwd),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    table.add(proc)
    data = command.encode("utf-8", "surrogateescape")
    try:
        try:
            out, _ = proc.communicate(data, timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_group(proc)
            # A grandchild that escaped the group could keep the pipe open; bound the drain.
            try:
                out, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                out = b""
            timed_out = True
    finally:
        table.discard(proc)
    return ExecOutcome(
        exit_code=go_exit_code(proc.returncode),
        output=out.decode("utf-8", errors="replace"),
        timed_out=timed_out,
    )


@dataclass
class SessionCommand:
    id: str
    command: str
    dir: Path
    exit_code: int | None = None
    #: time.monotonic() when the session's shell wrote the exit code
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def stdout(self) -> str:
        return _read_text(self.dir / "stdout")

    def stderr(self) -> str:
        return _read_text(self.dir / "stderr")


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


class ShellSession:
    """One daemon session: a long-lived shell reading command lines from its stdin.

    As the daemon's ``CreateSession``/``SessionExecuteCommand``
    (apps/daemon/pkg/toolbox/process/session/session.go, execute.go): the shell
    is ``GetShell()``'s (zsh, bash or sh, see ``images.py``), started with no
    arguments in the work directory; each command is written to its stdin as
    one line ``{ CMD; } > log 2>&1; echo "$?" > exit_code_file`` (here stdout
    and stderr go to two files, which the logs route returns as ``stdout``,
    ``stderr`` and both as ``output``). So commands of one session run one
    after the other, cwd and exports persist, a command that reads stdin eats
    the lines after it, ``exit`` ends the session, and the exit code is the
    shell's ``$?`` (128+N after a signal), known once that file is written.
    The shell prints the command id after the file, which tells this
    emulator without polling that the command has ended.
    """

    def __init__(
        self, session_id: str, *, cwd: Path, env: dict[str, str], state_dir: Path, table: ProcessTable, shell: str
    ):
        self.id = session_id
        self._dir = state_dir
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.commands: dict[str, SessionCommand] = {}
        self._table = table
        self._proc = subprocess.Popen(
            [shell],
            cwd=str(cwd),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        table.add(self._proc)
        self._reader = threading.Thread(target=self._read_markers, name=f"emu-session-{session_id}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read_markers(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            with self._lock:
                cmd = self.commands.get(raw.decode("utf-8", errors="replace").strip())
            if cmd is None:
                continue
            try:
                cmd.exit_code = int((cmd.dir / "exit_code").read_text().strip())
            except (OSError, ValueError):
                cmd.exit_code = None
            cmd.finished_at = time.monotonic()
            cmd.done.set()
        # The shell ended: a command it was running never gets its exit code file.
        self._proc.wait()
        self._table.discard(self._proc)

    def execute(self, command: str) -> SessionCommand:
        cmd_id = str(uuid.uuid4())
        cmd_dir = self._dir / cmd_id
        cmd_dir.mkdir(parents=True)
        cmd = SessionCommand(id=cmd_id, command=command, dir=cmd_dir)
        with self._lock:
            self.commands[cmd_id] = cmd
        q = lambda name: shlex.quote(str(cmd_dir / name))  # noqa: E731
        line = f'{{ {command}; }} > {q("stdout")} 2> {q("stderr")}; echo "$?" > {q("exit_code")}; echo {cmd_id}\n'
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(line.encode("utf-8", "surrogateescape"))
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # the shell is gone: the command never gets an exit code, as on the daemon
        return cmd

    def close(self) -> None:
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        kill_group(self._proc, grace=0.2)
        self._table.discard(self._proc)
        self._reader.join(timeout=5)
