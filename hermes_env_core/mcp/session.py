"""One MCP session's shell: its environment, its background processes, and the tools' work.

Plain synchronous code with no MCP import: the server runs each call in a
worker thread and turns what it returns (or raises) into a tool result.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from typing import Any

from ..environment.base import BaseEnvironment
from ..errors import HermesEnvError
from ..processes import (
    BackgroundProcess,
    Notification,
    NotificationKind,
    ProcessRegistry,
    WatchPattern,
)
from ..processes.sandbox import run_script

__all__ = ["McpShell", "ToolError"]

EnvironmentOpener = Callable[[], BaseEnvironment]

MAX_WAIT_S = 600.0
DEFAULT_READ_BYTES = 256 * 1024
DEFAULT_OUTPUT_BYTES = 64 * 1024
_READ_HELPER_TIMEOUT_S = 120.0
_WRITE_OK = "hermes-env-write-ok"


class ToolError(HermesEnvError):
    """A tool call that cannot be done: bad arguments, unknown process, unreadable file, ..."""


class McpShell:
    """The long-lived shell one MCP session sees.

    The environment is opened on first use, so a backend that cannot start
    makes that call fail with a clear tool error instead of the session.
    ``on_event(notification)`` hears about background exits and watch matches.
    Thread-safe.
    """

    def __init__(self, opener: EnvironmentOpener, *, on_event: Callable[[Notification], None] | None = None) -> None:
        self._opener = opener
        self._on_event = on_event
        self._env: BaseEnvironment | None = None
        self._registry: ProcessRegistry | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._seen: dict[str, int] = {}  # process id -> notifications already returned by process_wait
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def task_id(self) -> str | None:
        return self._env.task_id if self._env is not None else None

    @property
    def started(self) -> bool:
        return self._env is not None

    def environment(self) -> BaseEnvironment:
        with self._lock:
            if self._closed:
                raise ToolError("this MCP session is closed")
            if self._env is None:
                env = self._opener()
                self._registry = ProcessRegistry(on_notification=self._notified)
                self._env = env
            return self._env

    def _processes(self) -> ProcessRegistry:
        self.environment()
        assert self._registry is not None
        return self._registry

    def close(self) -> None:
        """Kill the session's background processes and release its environment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            env, reg = self._env, self._registry
        with self._changed:
            self._changed.notify_all()
        try:
            if reg is not None:
                reg.close()
        finally:
            if env is not None and getattr(env, "_named", None) is not None:
                env.detach()  # a named session stays for the next client
            elif env is not None:
                env.close()

    def _notified(self, note: Notification) -> None:
        with self._changed:
            self._changed.notify_all()
        if self._on_event is not None:
            self._on_event(note)

    def wake(self) -> None:
        """Wake waiting ``process_wait`` calls so they re-check their cancel flag."""
        with self._changed:
            self._changed.notify_all()

    # -- run ---------------------------------------------------------------------------
    def run(
        self,
        command: str,
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
        cancel: threading.Event | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> dict[str, Any]:
        if not command.strip():
            raise ToolError("argument 'command' is empty")
        env = self.environment()
        r = env.execute(command, cwd=cwd, timeout=timeout, stdin=stdin, cancel=cancel, on_output=on_output)
        return {
            "output": r.output,
            "exit_code": r.exit_code,
            "cwd": r.cwd,
            "timed_out": r.timed_out,
            "interrupted": r.interrupted,
            "truncated": r.truncated,
            "notes": list(r.notes),
            "duration_s": round(r.duration_s, 6),
            "task_id": env.task_id,
            "end_reason": str(r.end_reason),
            "signal": r.signal,
            "usage": {
                "cpu_user_s": r.usage.cpu_user_s,
                "cpu_system_s": r.usage.cpu_system_s,
                "max_rss_bytes": r.usage.max_rss_bytes,
                "oom_killed": r.usage.oom_killed,
            },
        }

    # -- background processes ------------------------------------------------------------
    def spawn(
        self,
        command: str,
        *,
        cwd: str | None = None,
        watch: list[str] | None = None,
        watch_regex: list[str] | None = None,
        pty: bool = False,
    ) -> dict[str, Any]:
        if not command.strip():
            raise ToolError("argument 'command' is empty")
        try:
            patterns = [WatchPattern(w) for w in watch or ()] + [WatchPattern(w, regex=True) for w in watch_regex or ()]
        except ValueError as exc:
            raise ToolError(str(exc)) from None
        env = self.environment()
        proc = self._processes().spawn(env, command, cwd=cwd, watch=patterns, pty=pty)
        return {**self._info(proc), "task_id": env.task_id}

    def _get(self, process_id: str) -> BackgroundProcess:
        reg = self._processes()
        if process_id not in reg:
            known = ", ".join(p.id for p in reg.list()) or "none"
            raise ToolError(f"no background process {process_id!r} in this session (known: {known})")
        return reg.get(process_id)

    @staticmethod
    def _info(proc: BackgroundProcess) -> dict[str, Any]:
        info = proc.info()
        return {
            "id": info.id,
            "command": info.command,
            "status": info.status.value,
            "pid": info.pid,
            "exit_code": info.exit_code,
            "started_at": info.started_at,
            "ended_at": info.ended_at,
            "pty": info.pty,
            "output_bytes": info.output_bytes,
            "watch": [str(p) for p in proc.patterns],
            "note": info.note,
        }

    def process_list(self) -> dict[str, Any]:
        env = self.environment()
        return {"processes": [self._info(p) for p in self._processes().list()], "task_id": env.task_id}

    def process_output(self, process_id: str, *, since: int = 0, max_bytes: int = DEFAULT_OUTPUT_BYTES) -> dict[str, Any]:
        if since < 0:
            raise ToolError(f"argument 'since' must be >= 0, not {since}")
        if max_bytes < 1:
            raise ToolError(f"argument 'max_bytes' must be >= 1, not {max_bytes}")
        proc = self._get(process_id)
        chunk = proc.read(since, max_bytes)
        return {
            "id": proc.id,
            "output": chunk.text,
            "offset": chunk.offset,
            "next_offset": chunk.next_offset,
            "dropped": chunk.dropped,
            "end": proc.output_end,
            "status": proc.status.value,
            "exit_code": proc.exit_code,
        }

    def process_wait(
        self, process_id: str, *, timeout: float = 30.0, cancel: threading.Event | None = None
    ) -> dict[str, Any]:
        """Until the process exits or prints a watched line not yet reported by an earlier wait."""
        if not 0 <= timeout <= MAX_WAIT_S:
            raise ToolError(f"argument 'timeout' must be between 0 and {MAX_WAIT_S:g} seconds, not {timeout}")
        proc = self._get(process_id)
        deadline = time.monotonic() + timeout
        event = "timeout"
        with self._changed:
            while True:
                notes = proc.notifications
                seen = self._seen.get(proc.id, 0)
                fresh = notes[seen:]
                matches = [n for n in fresh if n.kind is NotificationKind.MATCH]
                if matches:
                    event = "match"
                    break
                if not proc.running:
                    event = "exit"
                    break
                left = deadline - time.monotonic()
                if left <= 0 or self._closed or (cancel is not None and cancel.is_set()):
                    break
                # Notifications wake us; the bound only re-checks cancel and the deadline.
                self._changed.wait(min(left, 1.0))
            self._seen[proc.id] = len(notes)
        return {
            "id": proc.id,
            "event": event,
            "matches": [{"pattern": n.pattern or "", "line": n.text, "suppressed": n.suppressed} for n in matches],
            "status": proc.status.value,
            "exit_code": proc.exit_code,
            "output_end": proc.output_end,
            "tail": proc.tail(2000) if event == "exit" else "",
        }

    def process_kill(self, process_id: str, *, signal: str | None = None) -> dict[str, Any]:
        proc = self._get(process_id)
        if signal:
            if not proc.running:
                raise ToolError(f"background process {proc.id} is not running ({proc.status.value})")
            try:
                proc.send_signal(signal)
            except ValueError as exc:
                raise ToolError(f"argument 'signal': {exc}") from None
        else:
            proc.kill()
        return {"id": proc.id, "status": proc.status.value, "exit_code": proc.exit_code, "signal": signal}

    def process_write(self, process_id: str, data: str, *, close_stdin: bool = False) -> dict[str, Any]:
        proc = self._get(process_id)
        raw = data.encode("utf-8")
        if raw:
            proc.write(raw)
        if close_stdin:
            proc.close_stdin()
        return {"id": proc.id, "bytes_written": len(raw), "stdin_closed": close_stdin}

    # -- files ---------------------------------------------------------------------------
    def read_file(self, path: str, *, offset: int = 0, max_bytes: int = DEFAULT_READ_BYTES) -> dict[str, Any]:
        """Up to ``max_bytes`` of the file from ``offset``; a helper bash in the target reads it,
        outside the session, so the session's functions and ``$?`` play no part."""
        if not path:
            raise ToolError("argument 'path' is empty")
        if offset < 0:
            raise ToolError(f"argument 'offset' must be >= 0, not {offset}")
        env = self.environment()
        cwd = env.session.cwd
        script = (
            (f"cd -- {_q(cwd)} 2>/dev/null\n" if cwd else "")
            + f"p={_q(path)}\n"
            + 'if [ -d "$p" ]; then echo "E is a directory"; exit 0; fi\n'
            + 'if [ ! -e "$p" ]; then echo "E no such file"; exit 0; fi\n'
            + 'if [ ! -r "$p" ]; then echo "E permission denied"; exit 0; fi\n'
            + 'size=$(wc -c < "$p") || { echo "E cannot read"; exit 0; }\n'
            + 'echo "S $size"\n'
            + f'tail -c +{offset + 1} -- "$p" | head -c {max_bytes}\n'
        )
        code, out = run_script(env, script, timeout=_READ_HELPER_TIMEOUT_S)
        head, sep, data = out.partition(b"\n")
        if not sep or code != 0:
            raise ToolError(f"cannot read {path!r}: the helper exited {code}: {out[:200].decode('utf-8', 'replace')}")
        kind, _, rest = head.decode("utf-8", "replace").partition(" ")
        if kind == "E":
            raise ToolError(f"cannot read {path!r}: {rest}")
        size = int(rest.strip())
        text: str | None = None
        if b"\0" not in data:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                # A multi-byte character cut at the size cap is still text.
                if exc.start >= len(data) - 3 and len(data) == max_bytes:
                    try:
                        text = data[: exc.start].decode("utf-8")
                        data = data[: exc.start]
                    except UnicodeDecodeError:
                        text = None
        return {
            "path": path,
            "size": size,
            "offset": offset,
            "bytes": len(data),
            "truncated": offset + len(data) < size,
            "encoding": "utf-8" if text is not None else "base64",
            "content": text if text is not None else base64.b64encode(data).decode("ascii"),
            "task_id": env.task_id,
        }

    def write_file(
        self,
        path: str,
        content: str,
        *,
        encoding: str = "utf-8",
        append: bool = False,
        make_dirs: bool = False,
    ) -> dict[str, Any]:
        """Write through the session's shell (stdin carries the bytes on every backend); ``$?`` is kept."""
        if not path:
            raise ToolError("argument 'path' is empty")
        if encoding == "utf-8":
            data = content.encode("utf-8")
        elif encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except ValueError as exc:
                raise ToolError(f"argument 'content' is not valid base64: {exc}") from None
        else:
            raise ToolError(f"argument 'encoding' must be 'utf-8' or 'base64', not {encoding!r}")
        env = self.environment()
        p = _q(path)
        mkdir = f'command mkdir -p -- "$(command dirname -- {p})" && ' if make_dirs else ""
        redirect = ">>" if append else ">"
        # The command's own status stays the session's $?, as if the agent had not written anything.
        script = (
            "__hermes_rc=$?\n"
            f"if {mkdir}command cat {redirect} {p}; then printf '%s\\n' {_WRITE_OK}; fi\n"
            'eval "unset __hermes_rc; (exit $__hermes_rc)"'
        )
        r = env.execute(script, stdin=data)
        lines = r.output.splitlines()
        if _WRITE_OK not in lines:
            why = "\n".join(line for line in lines if line != _WRITE_OK).strip() or f"exit code {r.exit_code}"
            raise ToolError(f"cannot write {path!r}: {why}")
        return {"path": path, "bytes_written": len(data), "append": append, "task_id": env.task_id}


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
