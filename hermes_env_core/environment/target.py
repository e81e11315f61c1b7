"""``Target``: all a backend supplies to reach the place where commands run.

The session, the wrapper script, timeouts, cancel, output capture, notes and
the result are the core's; a target only starts bash there, runs helper
scripts, names a private directory and lets go. Documented like a hookspec:
each method says when it is called, what it must do and what it may not.

Versioning (``API_VERSION``): a minor version may add optional methods,
optional ``RunRequest`` fields with defaults and capabilities; only a major
version may remove or change what a target already implements. A plugin says
which version it was built for in ``BackendSpec.api_version``; a plugin built
for another major version is refused at load.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from ..errors import EnvironmentUnavailable, TargetLostError
from .base import BaseEnvironment
from .handles import ProcessHandle
from .options import EnvironmentConfig

__all__ = ["API_VERSION", "RunRequest", "Target", "TargetEnvironment", "parse_api_version"]

#: the version of the plugin API: this protocol and the ``hermes_env_backends`` hookspec
API_VERSION = "1.0"


def parse_api_version(text: str) -> tuple[int, int]:
    """``"1.0"`` -> ``(1, 0)``; a clear error for anything else."""
    major, dot, minor = str(text).partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        raise ValueError(f"plugin API version {text!r} is not of the form MAJOR.MINOR (such as {API_VERSION!r})")
    return int(major), int(minor)


@dataclass(frozen=True)
class RunRequest:
    """One bash process to start in the target.

    ``script`` is complete bash: run it as ``bash -c SCRIPT`` (``bash -l -c``
    when ``login``). It may be longer than the target's argv limit; a target
    that passes it on a command line must then feed it another way (a pipe,
    a file it removes). ``stdin`` is the process's whole standard input, to be
    followed by end of input (None: end of input at once, never a terminal).
    ``live_output``: someone watches the output as it comes, so deliver it
    as it is written, not only at the end. ``end_marker``: the bytes that end
    the core's frame on stdout; a target never needs to parse it, but one
    that can only return output at the end may stop reading after it.
    ``timeout`` is advisory: the core enforces it by killing the handle.
    """

    script: str
    login: bool = False
    stdin: bytes | None = None
    live_output: bool = False
    end_marker: bytes = b""
    timeout: float | None = None


@runtime_checkable
class Target(Protocol):
    """What a backend implements: how to reach its target, nothing else.

    Called from several threads at once (commands run concurrently); a target
    guards its own shared state. Raise ``EnvironmentUnavailable`` when the
    target cannot run anything, ``BackendError`` for a broken transport;
    never return a made-up exit code.
    """

    def start(self, request: RunRequest) -> ProcessHandle:
        """Start bash for ``request``; output (stdout and stderr merged, in order) on ``handle.stdout``.

        Called once per command and for the core's own snapshots. Raise
        ``TargetLostError`` when the target is gone: the core then calls
        ``recover`` and starts the command once more. The
        handle's ``kill()`` must end the whole process tree of the command in
        the target, including descendants that left its process group.
        """
        ...

    def run_helper(self, script: str, *, timeout: float) -> tuple[int, bytes]:
        """Run a short bash script outside the session and wait: (exit code, merged output).

        For the core's own work (background processes, file transfer checks);
        it sees no session state and must not change it.
        """
        ...

    def state_dir(self) -> str:
        """A directory in the target only the session's user can enter (0700, unguessable name).

        Called once, when the session starts, and again after ``recover``.
        """
        ...

    def recover(self, why: str) -> bool:
        """The target was lost (``why``); bring up a new one. True if it did (the core restores the session).

        Return False when the target cannot be recreated: the core then
        raises ``EnvironmentUnavailable`` with ``why``.
        """
        ...

    def release(self) -> None:
        """Let go of everything (containers, connections, temporary files). Called once, at close."""
        ...


_C = TypeVar("_C", bound=EnvironmentConfig)


class TargetEnvironment(BaseEnvironment, Generic[_C]):
    """A backend written against ``Target`` only: subclass, set ``name`` and
    ``config_model``, and implement ``make_target``. Everything else (state,
    timeouts, cancel, output, notes, the conformance suite) is the core's.
    """

    config_model: ClassVar[type[EnvironmentConfig]] = EnvironmentConfig
    config: _C

    def __init__(self, config: _C | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._target: Target | None = None
        self._target_lock = threading.Lock()

    @abc.abstractmethod
    def make_target(self, config: _C) -> Target:
        """Create the target (lazily: called before the first command). May raise ``EnvironmentUnavailable``."""

    @property
    def target(self) -> Target:
        if self._target is None:
            with self._target_lock:
                if self._target is None:
                    self._target = self.make_target(self.config)
        return self._target

    # -- the base class's steps, expressed through the target -------------------------
    def _state_dir(self) -> str:
        return self.target.state_dir()

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        request = RunRequest(script=script, login=login, stdin=stdin_data, timeout=timeout)
        target = self.target
        try:
            return target.start(request)
        except TargetLostError as exc:
            why = str(exc) or "the target was lost"
            with self._target_lock:
                recovered = target.recover(why)
            if not recovered:
                raise EnvironmentUnavailable(f"{self.name}: {why}; it could not be brought back") from exc
            self._note(f"{self.name}: {why}; the target was recreated and the session restored")
            return target.start(request)

    def cleanup(self) -> None:
        if self._target is not None:
            self._target.release()
