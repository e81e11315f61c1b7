"""How the base class talks to a running bash, whatever runs it.

``subprocess.Popen`` satisfies ``ProcessHandle`` as it is; backends whose SDK
offers only blocking calls wrap them in ``ThreadedProcessHandle``.
"""

from __future__ import annotations

import errno
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Protocol, runtime_checkable

from ..errors import BackendError

__all__ = ["ProcessHandle", "ThreadedProcessHandle", "Writer", "run_to_end"]

Writer = Callable[[bytes], None]


@runtime_checkable
class ProcessHandle(Protocol):
    """A started bash process.

    ``stdout`` must have a ``fileno()`` usable with ``select``; it carries
    stdout and stderr merged. ``kill()`` must end the process (a backend may
    make it end the whole tree). Optional extras the base class uses when
    present: ``terminate()`` for a graceful stop, ``error``, an exception
    that explains a failure of the transport, and ``notes``, strings added to
    this command's result only.
    """

    stdout: IO[bytes] | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class ThreadedProcessHandle:
    """Runs a blocking SDK call in a thread and exposes it as a process.

    ``target(write)`` runs the command, calls ``write(chunk)`` for output as it
    arrives (or once at the end, if the SDK cannot stream) and returns the exit
    code. An exception from it is kept in ``error`` and raised from ``wait()``
    as ``BackendError``: a failed SDK call is never a silent exit 1.
    """

    def __init__(
        self,
        target: Callable[[Writer], int],
        *,
        on_kill: Callable[[], None] | None = None,
        on_terminate: Callable[[], None] | None = None,
        name: str = "hermes-env-exec",
    ) -> None:
        r, w = os.pipe()
        self.stdout: IO[bytes] | None = os.fdopen(r, "rb", buffering=0)
        self._w = w
        self._wlock = threading.Lock()
        self._target = target
        self._on_kill = on_kill
        self._on_terminate = on_terminate
        self.returncode: int | None = None
        self.error: BaseException | None = None
        self.killed = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        with self._wlock:
            while view:
                if self._w < 0:
                    return
                try:
                    n = os.write(self._w, view)
                except BrokenPipeError:
                    return  # the reader is gone; drop output
                view = view[n:]

    def _run(self) -> None:
        try:
            self.returncode = int(self._target(self._write))
        except BaseException as exc:  # noqa: BLE001 - surfaced through wait()
            self.error = exc
        finally:
            with self._wlock:
                os.close(self._w)
                self._w = -1
            self._done.set()

    def poll(self) -> int | None:
        if not self._done.is_set():
            return None
        if self.error is not None:
            return -1 if self.returncode is None else self.returncode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise TimeoutError("command still running")
        if self.error is not None and not self.killed:
            raise BackendError(f"backend call failed: {self.error!r}") from self.error
        return -1 if self.returncode is None else self.returncode

    def terminate(self) -> None:
        if self._on_terminate is not None:
            self._on_terminate()
        else:
            self.kill()

    def kill(self) -> None:
        self.killed = True
        if self._on_kill is not None:
            self._on_kill()


_DRAIN_S = 0.2  # how long to keep reading after bash has exited (a background child may hold the pipe)


def run_to_end(handle: ProcessHandle, *, timeout: float) -> tuple[int, bytes]:
    """Read a started process's output to its end and reap it: (exit code, output).

    Past ``timeout`` the handle is killed and ``TimeoutError`` raised.
    """
    stdout = handle.stdout
    if stdout is None:
        raise ValueError("run_to_end: the handle has no stdout")
    fd = stdout.fileno()
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    exited_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                handle.kill()
                try:
                    handle.wait(timeout=5.0)
                except Exception:  # noqa: BLE001 - the timeout is the error to report
                    pass
                raise TimeoutError(f"helper script still running after {timeout:g}s; it was killed")
            ready, _, _ = select.select([fd], [], [], min(deadline - now, 0.05))
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError as exc:
                    if exc.errno in (errno.EAGAIN, errno.EINTR):
                        continue
                    data = b""
                if not data:
                    break
                chunks.append(data)
            elif handle.poll() is not None:
                exited_at = exited_at if exited_at is not None else now
                if now - exited_at > _DRAIN_S:
                    break
    finally:
        stdout.close()
    if isinstance(handle, subprocess.Popen):
        # bash is exiting: a plain wait() blocks in waitpid, where wait(timeout) polls with sleeps.
        return handle.wait(), b"".join(chunks)
    return handle.wait(timeout=max(deadline - time.monotonic(), 5.0)), b"".join(chunks)
