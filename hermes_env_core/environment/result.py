"""The record every ``execute()`` returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["EXIT_CANCELLED", "EXIT_CWD", "EXIT_TIMEOUT", "EndReason", "ExecResult", "Usage"]

EXIT_TIMEOUT = 124
EXIT_CWD = 126
EXIT_CANCELLED = 130


@dataclass(frozen=True)
class Usage:
    """What one command cost, as the target's kernel counted it; ``None`` where the target cannot tell.

    CPU times cover the command's whole tree (every process it waited for).
    ``max_rss_bytes`` is the peak resident memory of the largest process in
    it (``ru_maxrss``), or of the whole tree when measured by a cgroup.
    """

    cpu_user_s: float | None = None
    cpu_system_s: float | None = None
    max_rss_bytes: int | None = None
    oom_killed: bool | None = None

    def merged(self, other: Usage | None) -> Usage:
        """This record with the fields ``other`` knows and this one does not."""
        if other is None:
            return self
        return Usage(
            cpu_user_s=self.cpu_user_s if self.cpu_user_s is not None else other.cpu_user_s,
            cpu_system_s=self.cpu_system_s if self.cpu_system_s is not None else other.cpu_system_s,
            max_rss_bytes=self.max_rss_bytes if self.max_rss_bytes is not None else other.max_rss_bytes,
            oom_killed=self.oom_killed if self.oom_killed is not None else other.oom_killed,
        )


class EndReason(str, enum.Enum):
    """Why a command ended, in one word."""

    EXITED = "exited"  # it exited by itself (any exit code below 129)
    SIGNALED = "signaled"  # killed by signal ``signal`` (its status was 128+N)
    TIMED_OUT = "timed_out"  # hermes-env stopped it at its timeout
    CANCELLED = "cancelled"  # hermes-env stopped it on cancel
    OOM_KILLED = "oom_killed"  # the kernel's OOM killer ended it
    # A target lost under a command (container removed, connection dropped) is
    # no ending of the command's own: execute() raises BackendError instead.

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command.

    ``output`` is stdout and stderr merged in the order they were written.
    ``notes`` carries facts the agent should see that are not the command's
    output (the environment was recreated, the memory limit was hit, a restore
    failed); they are never mixed into ``output``. ``usage`` is what it cost
    and ``end_reason`` why it ended. A status of 128+N counts as signal N,
    the shell's own convention: a command that itself exits 137 reads the same.
    """

    output: str
    exit_code: int
    timed_out: bool = False
    interrupted: bool = False
    truncated: bool = False
    cwd: str | None = None
    duration_s: float = 0.0
    output_path: str | None = None
    dropped_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    usage: Usage = field(default_factory=Usage)
    end_reason: EndReason = EndReason.EXITED
    #: the signal that ended it, when ``end_reason`` is SIGNALED or OOM_KILLED
    signal: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0
