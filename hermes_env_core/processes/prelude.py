"""The script a background process starts with: the session's state, as a foreground command sees it.

Built from the session's own restore text, so variables, functions, aliases,
options and the working directory match what ``execute()`` would restore.
"""

from __future__ import annotations

import posixpath
import shlex

from ..environment.session import ShellSession, ansi_c_quote

__all__ = ["resolve_cwd", "session_script"]


def resolve_cwd(session: ShellSession, cwd: str | None) -> str | None:
    """``cwd`` (relative ones against the session's), else the session's cwd."""
    current = session.cwd
    if cwd is None:
        return current
    if current and not posixpath.isabs(cwd):
        return posixpath.join(current, cwd)
    return cwd


def session_script(session: ShellSession, command: str, *, cwd: str | None = None) -> str:
    """A bash script: restore ``session``'s state, enter the directory, run ``command``.

    Exits 126 with a message naming the directory when it cannot be entered,
    as ``execute()`` does. The preamble is one physical line, so bash's
    messages number the command's lines as in a plain ``bash -c``.
    """
    state = session.state
    baseline = session.baseline
    parts: list[str] = []
    if state is not None:
        parts.append(session._restore_text(state, baseline))
    target = resolve_cwd(session, cwd)
    if target:
        q = shlex.quote(target)
        parts.append(
            f"builtin cd -- {q} 2>/dev/null || {{ builtin printf "
            f"'hermes-env: cannot enter working directory: %s\\n' {q}; exit 126; }}\n"
        )
    if state is not None:
        parts.append(session._options_text(state, baseline))
    return "builtin eval " + ansi_c_quote("".join(parts)) + "\n" + command + "\n"
