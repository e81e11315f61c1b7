"""The command lines sent to the daemon: one line that makes its shell (zsh, bash or sh) run bash."""

from __future__ import annotations

import re
import secrets
import shlex

__all__ = [
    "ARG_LIMIT", "bash_line", "exports", "file_script", "file_session_line", "nonce_of", "session_line",
    "stub_session_line", "trailer_line",
]

#: Above this size a script goes up as a file: one argv string is capped at 128 KiB, and a
#: request body of megabytes is not what the daemon's command routes are made for.
ARG_LIMIT = 100_000

# The wrapper names its nonce in its state separator (and, in older cores, in __hermes_n=).
_NONCE_RE = re.compile(r"#hermes-state:([0-9a-f]{8,64})|__hermes_n=([0-9a-f]{8,64});")


def nonce_of(script: str) -> str | None:
    """The per-command nonce the session wrapper put in ``script`` (it marks the frame)."""
    m = _NONCE_RE.search(script)
    return (m.group(1) or m.group(2)) if m else None


def bash_line(script: str, *, login: bool) -> str:
    """The command line that runs ``script`` in bash, whatever shell the daemon uses.

    The daemon starts zsh, bash or sh (the first its image lists) and writes
    the command line to that shell's stdin. The script must never be that
    input itself: its first line moves stdin (``exec ... </dev/null``), and a
    shell reading its commands from stdin stops there. So the daemon's shell
    only reads this one line and becomes bash, which gets the script as an
    argument.
    """
    return f"exec bash{' -l' if login else ''} -c {shlex.quote(script)}"


def exports(env: dict[str, str] | None) -> str:
    """Script text (no newline) that exports ``env``."""
    if not env:
        return ""
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + "; "


def trailer_line(token: str) -> str:
    """What the session command prints after bash has exited (see ``session_line``)."""
    return f"\x1ehermes-end:{token}\n"


def session_line(script: str, *, login: bool, token: str) -> str:
    """The command a daemon session runs: bash reading ``script`` from a here-document on fd 3.

    A session is one shell (zsh, bash or sh) reading its command lines from
    stdin, so the command must not read that stdin (it would eat the lines
    after it) nor ``exec`` (it would end the session's shell). The script
    travels in the here-document, never as an argument, where anyone in the
    sandbox could read it in ``/proc/<pid>/cmdline`` (it carries the session's
    variables and ``env``). The daemon wraps the command as ``{ CMD; } > log``
    (session/execute.go), so the line after the delimiter keeps bash's status
    and lets the wrapper's ``; }`` follow. Before that it prints
    ``trailer_line(token)`` (a builtin: the token is on no command line), which
    tells that the output is complete even when bash ended without its own
    end record (a helper script, a SIGKILL).
    """
    body = f"exec 3<&-; {script}"
    lines = set(body.split("\n"))
    delim = f"HERMES_{secrets.token_hex(8)}"
    while delim in lines:
        delim = f"HERMES_{secrets.token_hex(8)}"
    head = f"bash{' -l' if login else ''} /dev/fd/3 3<<'{delim}' </dev/null 2>&1"
    tail = f"__hermes_rc=$?; printf '\\036hermes-end:%s\\n' {token}; (exit $__hermes_rc)"
    return f"{head}\n{body}\n{delim}\n{tail}"


def stub_session_line(stub: str, *, login: bool, token: str) -> str:
    """The session command for the core's constant stub (its private script is in a file).

    The stub holds no state, nonce or value, so it may be an argument: bash
    gets it with ``-c`` and ``$0 = bash``, which is what bash's own messages
    are named after (``bash: line 1: ...``), as with one long-lived bash.
    """
    return (
        f"bash{' -l' if login else ''} -c {shlex.quote(stub)} bash </dev/null 2>&1; "
        f"__hermes_rc=$?; printf '\\036hermes-end:%s\\n' {token}; (exit $__hermes_rc)"
    )


def file_session_line(path: str, *, login: bool, token: str) -> str:
    """The session command for a script uploaded as a file (see ``file_script``)."""
    return (
        f"bash{' -l' if login else ''} {shlex.quote(path)} </dev/null 2>&1; "
        f"__hermes_rc=$?; printf '\\036hermes-end:%s\\n' {token}; (exit $__hermes_rc)"
    )


def file_script(script: str) -> bytes:
    """``script`` as a file for ``bash FILE``, which deletes itself as it starts."""
    return ('{ command rm -f -- "$0"; } 2>/dev/null; ' + script).encode("utf-8", "surrogateescape")
