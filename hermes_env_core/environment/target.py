"""``Target``: all a backend supplies to reach the place where commands run.

The session, the wrapper script, timeouts, cancel, output capture, notes and
the result are the core's; a target only starts bash there, runs helper
scripts, names a private directory and lets go. Documented like a hookspec:
each method says when it is called, what it must do and what it may not.

Versioning (``API_VERSION``, ``MAJOR.MINOR``): a minor version may add
optional methods (with a default, or looked up only when present), optional
``RunRequest`` fields with defaults, optional ``BackendSpec`` fields and new
capabilities; a plugin built for 1.0 runs unchanged on every 1.x. Only a
major version may remove or rename anything, change a signature, a
method's meaning or a default, or make something optional required. A
plugin says which version it was built for in ``BackendSpec.api_version``; a
plugin built for another major version is refused at load.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from ..errors import EnvironmentClosedError, EnvironmentUnavailable, TargetLostError
from ..plugins.spec import API_VERSION, parse_api_version
from .base import BaseEnvironment
from .channel import ChannelStream
from .handles import ProcessHandle, run_to_end
from .options import EnvironmentConfig
from .session import WrappedCommand

__all__ = [
    "API_VERSION", "RunRequest", "Target", "TargetEnvironment", "TargetLostError", "parse_api_version", "run_to_end",
]

@dataclass(frozen=True)
class RunRequest:
    """One bash process to start in the target.

    ``script`` is complete bash: run it as ``bash -c SCRIPT`` (``bash -l -c``
    when ``login``). It may be longer than the target's argv limit; a target
    that passes it on a command line must then feed it another way (a pipe,
    a file it removes). ``stdin`` is the process's whole standard input, to be
    followed by end of input (None: end of input at once, never a terminal).
    ``timeout`` is advisory: the core enforces it by killing the handle.
    ``live_output`` (someone watches output as it comes) and ``end_marker``
    (the bytes that end the core's frame on stdout) are hints for targets
    that can only return output at the end; a target may ignore both, and
    this core version leaves them at their defaults.
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
    never return a made-up exit code. A class that names ``Target`` as a
    base inherits the default ``run_helper``.
    """

    def start(self, request: RunRequest) -> ProcessHandle:
        """Start bash for ``request``; output (stdout and stderr merged, in order) on ``handle.stdout``.

        Called once per command and for the core's own snapshots. Raise
        ``TargetLostError`` when the target is gone: the core then calls
        ``recover`` and starts the command once more. The handle's ``kill()``
        must end the whole process tree of the command in the target,
        including descendants that left its process group. Optional handle
        extras the core uses when present: ``terminate()`` (graceful stop of
        the tree), ``tree_alive() -> bool`` (is anything of the tree left),
        ``notes`` and ``usage``. ``hermes_env_core.backends.local.start_bash``
        gives all of them for bash on this machine.
        """
        ...

    def run_helper(self, script: str, *, timeout: float) -> tuple[int, bytes]:
        """Run a short bash script outside the session and wait: (exit code, merged output).

        For the core's own work (background processes, file transfer checks);
        it sees no session state and must not change it. Raise ``TimeoutError``
        when it runs past ``timeout`` (after killing it). The default runs it
        through ``start`` and ``run_to_end``.
        """
        return run_to_end(self.start(RunRequest(script=script, timeout=timeout)), timeout=timeout)

    def state_dir(self) -> str:
        """A directory in the target only the session's user can enter (0700, unguessable name).

        Asked once, when the session starts; after ``recover`` the same path
        must be usable again.
        """
        ...

    def recover(self, why: str) -> bool:
        """The target was lost (``why``); bring up a new one. True if it did.

        Called at most once per loss, never concurrently with itself. The
        session's state is kept by the core, so the next command gets it
        back. Return False when the target cannot be recreated: the core then
        raises ``EnvironmentUnavailable`` with ``why``.
        """
        ...

    def release(self) -> None:
        """Let go of everything (containers, connections, temporary files). Called once, at close."""
        ...

    # Optional capability, looked up only when present (not part of the
    # protocol's required methods):
    #
    #   def open_channel(self, argv: Sequence[str]) -> ChannelStream
    #
    # Start ``argv`` (a bash, non-login, the user, env and cwd of ``start``)
    # with its stdin and stdout as one long-lived byte stream, no tty, stderr
    # kept out. The core then runs a resident shell server on it and sends
    # every command through it (see ``environment.channel``); raise
    # ``EnvironmentUnavailable`` when the target cannot be reached (that
    # command then goes through ``start``, which recovers a lost target).
    #
    #   def explain_exit(self, started: float) -> tuple[int, str] | None
    #
    # The session server's stream ended during a command that started at
    # ``started`` (wall clock): ``(exit code, why)`` when the target can tell
    # what ended it (the shell's own exit status, an OOM kill); None when it
    # cannot, and the command then fails as an infrastructure error.




_C = TypeVar("_C", bound=EnvironmentConfig)


class TargetEnvironment(BaseEnvironment, Generic[_C]):
    """A backend written against ``Target`` only.

    Subclass it as ``TargetEnvironment[MyConfig]``, set ``name`` and
    ``config_model``, and implement ``make_target``; ``self.config`` is then
    typed as ``MyConfig``. Everything else (state, timeouts, cancel, output,
    notes, the conformance suite) is the core's.
    """

    config_model: ClassVar[type[EnvironmentConfig]] = EnvironmentConfig
    #: ``Target.state_dir`` is private by contract (0700, unguessable)
    state_dir_private: ClassVar[bool] = True
    config: _C

    def __init__(self, config: _C | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._target: Target | None = None
        self._target_lock = threading.Lock()
        self._released = False
        self._generation = 0  # how many times the target was recovered

    @abc.abstractmethod
    def make_target(self, config: _C) -> Target:
        """Create the target (lazily: before the first command). May raise ``EnvironmentUnavailable``."""

    @property
    def target(self) -> Target:
        """The target, made by ``make_target`` on first use."""
        target = self._target
        if target is None:
            with self._target_lock:
                if self._released:
                    raise EnvironmentClosedError(f"{self.name} environment {self.task_id!r} is closed")
                if self._target is None:
                    made = self.make_target(self.config)
                    if not isinstance(made, Target):
                        missing = [m for m in ("start", "run_helper", "state_dir", "recover", "release")
                                   if not callable(getattr(made, m, None))]
                        raise TypeError(
                            f"{type(self).__name__}.make_target returned {made!r}, which is not a Target "
                            f"(missing: {', '.join(missing)})"
                        )
                    self._target = made
                target = self._target
        return target

    def run_helper(self, script: str, *, timeout: float = 60.0) -> tuple[int, bytes]:
        """Run ``script`` in the target outside the session: (exit code, merged output)."""
        return self.target.run_helper(script, timeout=timeout)

    # -- the base class's steps, expressed through the target -------------------------
    def _state_dir(self) -> str:
        return self.target.state_dir()

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        request = RunRequest(script=script, login=login, stdin=stdin_data, timeout=timeout)
        target = self.target
        generation = self._generation
        try:
            return target.start(request)
        except TargetLostError as exc:
            why = str(exc) or "the target was lost"
            with self._target_lock:
                # Concurrent commands lose the target together: one recovers it.
                if generation == self._generation:
                    if not target.recover(why):
                        raise EnvironmentUnavailable(f"{self.name}: {why}; it could not be brought back") from exc
                    self._generation += 1
                    self._note(f"{self.name}: {why}; the target was recreated and the session state restored")
            return target.start(request)

    def _run_helper(self, script: str, *, timeout: float) -> tuple[int, bytes]:
        return self.target.run_helper(script, timeout=timeout)

    @property
    def offers_channel(self) -> bool:
        return callable(getattr(self.target, "open_channel", None))

    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        target = self.target
        generation = self._generation
        try:
            stream: ChannelStream = target.open_channel(argv)  # type: ignore[attr-defined]
            return stream
        except TargetLostError as exc:
            # The target is gone (a deleted pod): bring it back once, as a command's start would.
            # Any other error (a refused exec, a target that cannot start) is not a loss: raised as it is.
            why = str(exc) or "the target was lost"
            with self._target_lock:
                if generation == self._generation:
                    if not target.recover(why):
                        raise
                    self._generation += 1
                    self._note(f"{self.name}: {why}; the target was recreated and the session state restored")
            stream = target.open_channel(argv)  # type: ignore[attr-defined]
            return stream

    def _explain_lost(self, started: float) -> tuple[int, str] | None:
        explain = getattr(self.target, "explain_exit", None)
        return explain(started) if callable(explain) else None

    def _tree_alive(self, handle: ProcessHandle, wrapped: WrappedCommand) -> bool | None:
        probe = getattr(handle, "tree_alive", None)
        return bool(probe()) if callable(probe) else None

    def cleanup(self) -> None:
        with self._target_lock:
            target, self._target, self._released = self._target, None, True
        if target is not None:
            target.release()
