"""The record every ``execute()`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ExecResult", "EXIT_TIMEOUT", "EXIT_CWD", "EXIT_CANCELLED"]

EXIT_TIMEOUT = 124
EXIT_CWD = 126
EXIT_CANCELLED = 130


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command.

    ``output`` is stdout and stderr merged in the order they were written.
    ``notes`` carries facts the agent should see that are not the command's
    output (the environment was recreated, the memory limit was hit, a restore
    failed); they are never mixed into ``output``.
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

    @property
    def ok(self) -> bool:
        return self.exit_code == 0
