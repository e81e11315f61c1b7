"""Finding a command's bash in the target by the random token on its command
line, so that a kill can never hit a process that merely reused a pid."""

from __future__ import annotations

import shlex

__all__ = ["exec_head", "find_pids_script", "parse_pids"]

# Reads a pidfile and checks that the pid is still the bash of this exec (its
# command line carries the token); else finds that bash by the token. The
# pattern is split in two so that this script's own command line never matches.
_FIND_PIDS = r"""t1=hermes-exec: t2=%(token)s
mine() { local -a a; mapfile -d '' a <"/proc/$1/cmdline" 2>/dev/null || return 1; [[ "${a[*]}" == *"$t1$t2"* ]]; }
p=; IFS= read -r p <%(pidfile)s 2>/dev/null
if [[ $p =~ ^[0-9]+$ ]] && mine "$p"; then echo "$p"; exit 0; fi
for d in /proc/[0-9]*; do q=${d#/proc/}; [ "$q" = "$$" ] && continue; mine "$q" && echo "$q"; done
exit 0
"""


def exec_head(token: str) -> str:
    """The no-op first statement that puts ``token`` on the exec's command line."""
    return f": hermes-exec:{token}; "


def find_pids_script(token: str, pidfile: str | None) -> str:
    return _FIND_PIDS % {"token": token, "pidfile": shlex.quote(pidfile or "/nonexistent")}


def parse_pids(out: bytes | str) -> tuple[int, ...]:
    text = out.decode("ascii", "replace") if isinstance(out, bytes) else out
    return tuple(int(x) for x in text.split() if x.isdigit())
