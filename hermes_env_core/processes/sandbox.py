"""Background processes inside a target reached only through short exec calls (docker, ssh, ...).

The process is started detached from the exec that starts it, writes to a
log file in the target, and is followed by one poll at a time: each poll waits
in the target (woken at once by the process's exit), then returns the exit
status and only the bytes past the offset already read.
"""

from __future__ import annotations

import logging
import shlex
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..environment.base import BaseEnvironment
from ..errors import EnvironmentUnavailable, HermesEnvError, UnsupportedOperation
from . import sandbox_scripts as scripts
from .process import ProcessError, ProcessStatus

if TYPE_CHECKING:
    from .process import BackgroundProcess

__all__ = ["DEFAULT_POLL", "PollSettings", "SandboxDriver", "missing_tools", "run_script", "target_label"]

log = logging.getLogger(__name__)

_WRITE_CHUNK = 16 * 1024
_SCRIPT_SLACK_S = 30.0  # beyond a script's own waiting, before it counts as hung
_STREAM_HELLO = b"hermes-env-stream\n"


@dataclass(frozen=True)
class PollSettings:
    """How a process in a sandbox is followed.

    A poll waits in the target up to the current interval (an exit ends the
    wait at once); the interval starts at ``min_s``, grows by ``factor`` after
    each poll without output up to ``max_s``, and drops back to ``min_s`` when
    output arrives. ``max_read`` caps the bytes one poll brings back.
    ``lost_after_s``: how long polls may fail before the process counts as lost.
    """

    min_s: float = 0.05
    max_s: float = 2.0
    factor: float = 2.0
    max_read: int = 4 * 1024 * 1024
    lost_after_s: float = 120.0


DEFAULT_POLL = PollSettings()

def target_label(env: BaseEnvironment) -> str:
    """The target as a user names it: ``image 'python:3.12'`` where there is an image, else its backend."""
    image = getattr(env.config, "image", None)
    return f"image {image!r}" if isinstance(image, str) and image else f"the {env.name} target"


def missing_tools(env: BaseEnvironment, names: tuple[str, ...] = scripts.REQUIRED_TOOLS) -> list[str]:
    """Which of ``names`` the target lacks (for ``hermes-env doctor``)."""
    _, out = run_script(env, scripts.tools_script(names), timeout=60.0)
    for line in out.decode("utf-8", "replace").splitlines():
        if line.startswith("hermes-bg-missing "):
            return line.split()[1:]
    return []


def run_script(env: BaseEnvironment, script: str, *, timeout: float) -> tuple[int, bytes]:
    """Run a helper script in the target, bypassing the session (its state is neither restored nor saved).

    The session is for the agent's commands: restoring kilobytes of state for
    every poll would cost more than the poll, and saving it back could clobber
    what a concurrent foreground command just stored.
    """
    return env.run_outside(script, timeout=timeout)


class SandboxDriver:
    """A detached process in ``env``'s target, in directory ``dir``."""

    kind = "sandbox"

    def __init__(
        self,
        env: BaseEnvironment,
        *,
        dir: str,
        pid: tuple[int, int],
        wrapper: tuple[int, int],
        offset: int = 0,
        pty: bool = False,
        poll: PollSettings = DEFAULT_POLL,
    ) -> None:
        self.env = env
        self.pty = pty
        self.dir = dir
        self.pid: int | None = pid[0]
        self.start_time = pid[1]
        self._wrapper = wrapper
        self.offset = offset
        self.poll = poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: seconds of silence after which a PTY process is checked for a terminal read
        self.input_wait_s: float | None = None
        self._quiet_since = time.monotonic()
        self._wait_reported = False

    @classmethod
    def launch(
        cls,
        env: BaseEnvironment,
        *,
        name: str,
        script: str,
        base: str = scripts.DEFAULT_BASE,
        login: bool = False,
        pty: bool = False,
        size: tuple[int, int] = (24, 80),
        poll: PollSettings = DEFAULT_POLL,
    ) -> SandboxDriver:
        code, out = run_script(
            env, scripts.launch_script(base, name, script, login=login, pty=pty, size=size), timeout=60.0
        )
        text = out.decode("utf-8", "replace")
        for line in text.splitlines():
            if line.startswith("hermes-bg-ok "):
                parts = line.split()
                try:
                    d = parts[1]
                    c, ct, w, wt = (int(x) for x in parts[2:6])
                except (IndexError, ValueError):
                    break
                return cls(env, dir=d, pid=(c, ct), wrapper=(w, wt), pty=pty, poll=poll)
            if line.startswith("hermes-bg-missing "):
                missing = line.split()[1:]
                raise UnsupportedOperation(
                    f"{env.name}: background processes need {', '.join(scripts.REQUIRED_TOOLS)} in the target "
                    f"(coreutils), and {target_label(env)} has no {', '.join(missing)}: install coreutils there "
                    "(or use an image that has it)"
                )
            if "hermes-bg-error no-script" in line:
                raise UnsupportedOperation(
                    f"{env.name}: pty=True needs script(1) from util-linux in the target; {target_label(env)} "
                    "has none"
                )
        raise ProcessError(f"{env.name}: could not start a background process (exit {code}): {text.strip()[-500:]}")

    # -- following ---------------------------------------------------------------
    def start(self, proc: BackgroundProcess) -> None:
        self._thread = threading.Thread(target=self._follow, args=(proc,), name=f"hermes-env-bg-{proc.id}", daemon=True)
        self._thread.start()

    def _follow(self, proc: BackgroundProcess) -> None:
        try:
            self._follow_polls(proc)
        except Exception as exc:  # a bug here must still end the process's record
            log.exception("hermes-env: following background process %s failed", proc.id)
            proc._finish(None, status=ProcessStatus.LOST, note=f"following it failed: {exc!r}")

    def _follow_polls(self, proc: BackgroundProcess) -> None:
        p = self.poll
        wait = p.min_s
        failing_since: float | None = None
        while not self._stop.is_set():
            check = False
            if self.pty and self.input_wait_s is not None and not self._wait_reported:
                due_in = self._quiet_since + self.input_wait_s - time.monotonic()
                check = due_in <= wait
                wait = min(wait, max(due_in, p.min_s))
            try:
                _, out = run_script(
                    self.env,
                    scripts.poll_script(self.dir, self.offset, wait, p.max_read, self._wrapper, input_check=check),
                    timeout=wait + _SCRIPT_SLACK_S,
                )
            except EnvironmentUnavailable as exc:
                if self._stop.is_set() or self.env.closed:
                    return
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= p.lost_after_s:
                    proc._finish(None, status=ProcessStatus.LOST, note=f"lost contact with {self.env.name}: {exc}")
                    return
                self._stop.wait(min(p.max_s, 1.0))
                continue
            failing_since = None
            head, nl, data = out.partition(b"\n")
            if not nl:
                continue  # a cut-off reply: ask again
            if self._stop.is_set():
                return
            if data:
                self._quiet_since = time.monotonic()
                self._wait_reported = False
                proc._feed(data)
                self.offset += len(data)
            status, _, flag = head.decode("ascii", "replace").strip().partition(" ")
            more = len(data) >= p.max_read
            if status == "-" and flag == "w" and not data and not self._wait_reported:
                self._wait_reported = True
                proc._waiting_for_input()
            if status == "-":
                wait = 0.0 if more else p.min_s if data else min(max(wait, p.min_s) * p.factor, p.max_s)
                continue
            if more:
                wait = 0.0
                continue
            if status == "lost":
                proc._finish(
                    None, status=ProcessStatus.LOST, note="its wrapper in the target ended without recording an exit code"
                )
            elif status == "gone":
                proc._finish(None, status=ProcessStatus.LOST, note=f"its directory {self.dir} is gone from the target")
            else:
                try:
                    code = int(status)
                except ValueError:
                    continue
                proc._finish(code)
            return

    # -- control -------------------------------------------------------------------
    def _run(self, script: str, what: str, timeout: float = 30.0) -> tuple[int, bytes]:
        try:
            return run_script(self.env, script, timeout=timeout)
        except EnvironmentUnavailable as exc:
            raise ProcessError(f"cannot {what} background process pid {self.pid} in {self.env.name}: {exc}") from exc

    def write(self, data: bytes, timeout: float) -> None:
        self._quiet_since = time.monotonic()
        self._wait_reported = False
        for i in range(0, len(data), _WRITE_CHUNK):
            code, out = self._run(scripts.write_script(self.dir, data[i : i + _WRITE_CHUNK]), "write to", timeout)
            if code == 3:
                raise ProcessError(f"background process pid {self.pid} has exited; stdin is gone")
            if code != 0:
                raise ProcessError(f"writing to pid {self.pid}'s stdin failed (exit {code}): {out[-200:]!r}")

    def close_stdin(self) -> None:
        if self.pty:
            # A terminal has no EOF of its own: Ctrl-D at the start of a line is one.
            self.write(b"\x04", 10.0)
            return
        self._run(scripts.close_stdin_script(self._wrapper), "close stdin of")

    def send_signal(self, sig: int) -> None:
        self._run(scripts.signal_script(self.dir, (self.pid or 0, self.start_time), sig, pty=self.pty), "signal")

    def kill_tree(self, grace: float) -> None:
        self._run(
            scripts.kill_script(self.dir, (self.pid or 0, self.start_time), self._wrapper, grace),
            "kill",
            grace + _SCRIPT_SLACK_S,
        )

    def set_window_size(self, rows: int, cols: int) -> None:
        code, _ = self._run(scripts.resize_script(self.dir, rows, cols), "resize")
        if code != 0:
            raise ProcessError(f"background process pid {self.pid}: its terminal is not known yet")

    def open_stream(self) -> Any | None:
        """A channel to the target copying its stdin into the process's input FIFO and the
        process's output file, from the start, to its stdout until the wrapper ends; None
        when the environment opens no channels (or they are turned off) or the target has
        no GNU tail (``--pid``)."""
        opener = getattr(self.env, "_open_channel", None)
        if (
            not callable(opener)
            or not getattr(self.env, "offers_channel", False)
            or not getattr(self.env.config, "channel", True)
            or self.env.closed
        ):
            return None
        # <> on the FIFO: the open never blocks, even when the process has just ended.
        script = (
            "tail --version 2>/dev/null | grep -q GNU || exit 3; "
            f"d={shlex.quote(self.dir)}; cat <&0 1<>\"$d/in\" 2>/dev/null & "
            f"builtin printf '{_STREAM_HELLO.decode()}'; "
            f'exec tail -c +1 -s 0.05 --pid={int(self._wrapper[0])} -f "$d/out"'
        )
        try:
            stream = opener(["bash", "-c", script])
        except (HermesEnvError, NotImplementedError, OSError):
            return None
        # Only a stream whose relay started takes keys: else they would go nowhere.
        head = b""
        while len(head) < len(_STREAM_HELLO):
            data = stream.read(len(_STREAM_HELLO) - len(head))
            if not data:
                stream.close()
                return None
            head += data
        if head != _STREAM_HELLO:
            stream.close()
            return None
        return stream

    def waiting_now(self, quiet_s: float) -> bool:
        """Is it blocked reading its terminal right now, silent for ``quiet_s``? (PTY processes)"""
        if not self.pty:
            return False
        _, out = self._run(scripts.waiting_script(self.dir, quiet_s), "check")
        return out.strip() == b"w"

    def stop(self) -> None:
        self._stop.set()

    def remove(self) -> None:
        """Delete the process's directory in the target (best effort)."""
        if not self.env.closed:
            try:
                run_script(self.env, scripts.remove_script(self.dir), timeout=30.0)
            except EnvironmentUnavailable:
                pass

    def read_log(self, offset: int = 0, max_bytes: int = 64 * 1024 * 1024) -> bytes:
        """Bytes of the full log in the target, from ``offset``."""
        return self._run(scripts.read_log_script(self.dir, offset, max_bytes), "read the log of", 120.0)[1]

    def check(self) -> tuple[str, int | None, int]:
        """(``alive``/``exited``/``reused``/``dead``/``gone``, exit code, log size) as the target sees it."""
        _, out = self._run(scripts.check_script(self.dir, (self.pid or 0, self.start_time)), "check")
        words = out.decode("ascii", "replace").split()
        if not words:
            raise ProcessError(f"{self.env.name}: no answer checking background process pid {self.pid}")
        state = words[0]
        if state == "exited" and len(words) >= 3:
            return state, _int(words[1]), _int(words[2]) or 0
        if state == "alive" and len(words) >= 2:
            return state, None, _int(words[1]) or 0
        return state, None, 0

    def record(self) -> dict[str, Any]:
        return {
            "driver": self.kind,
            "dir": self.dir,
            "pid": self.pid,
            "start_time": self.start_time,
            "wrapper_pid": self._wrapper[0],
            "wrapper_start": self._wrapper[1],
            "pty": self.pty,
        }


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None
