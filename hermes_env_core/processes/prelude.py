"""The script a background process starts with: the session's state, as a foreground command sees it."""

from __future__ import annotations

from ..environment.session import ShellSession

__all__ = ["session_script"]


def session_script(session: ShellSession, command: str, *, cwd: str | None = None) -> str:
    """Restore ``session``'s state, enter the directory (126 naming it if it
    cannot be entered, as ``execute()`` does), run ``command``."""
    return session.restore_script(command, cwd=cwd)
