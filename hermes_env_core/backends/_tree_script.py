"""The bash script that finds and signals a command's processes in a remote target.

A command's processes are its bash, that bash's process group, the
descendants of either, the processes carrying the command's environment marker
(docker), and the ones an earlier signal found (``pid:starttime``, so a
process re-parented after bash exited, or a recycled pid, is told apart).
Builtins only: it must run when a pids limit is exhausted.
"""

from __future__ import annotations

import re

__all__ = ["TREE_DONE", "parse_tree_output", "tree_script"]

#: Last line of the script's output: the signals are sent.
TREE_DONE = "hermes-kill-done"

# Fields after "pid (comm) ": $1 state, $2 ppid, $3 pgrp, ..., $20 starttime.
# One signal per process and round: a second TERM would cut bash's EXIT trap
# short. Stopped first, so none forks or exits between the listing and the
# signal. Signal 0 only reports what is alive.
_TREE_FN = r"""__hermes_tree() {
local sig=$1 root=$2 rounds=$3 mark=$4 p q s
shift 4
local -A keep=() kids=() start=() seen=()
local -a todo=() all=() e=()
for p in "$@"; do keep[${p%%:*}]=${p#*:}; done
while ((rounds--)); do
  kids=() start=() seen=() todo=() all=()
  for p in /proc/[0-9]*; do
    IFS= read -r s 2>/dev/null <"$p/stat" || continue
    s=${s##*) }; set -- $s
    [[ $1 == Z ]] && continue
    q=${p#/proc/}
    kids[$2]+=" $q"; start[$q]=${20}
    if [[ -n ${keep[$q]} ]]; then
      [[ ${keep[$q]} == "${20}" ]] && todo+=("$q")
    elif [[ $q == "$root" || $3 == "$root" ]]; then todo+=("$q")
    elif [[ -n $mark ]] && mapfile -d '' -t e 2>/dev/null <"$p/environ" \
      && [[ " ${e[*]} " == *" $mark "* ]]; then todo+=("$q")
    fi
  done
  while ((${#todo[@]})); do
    p=${todo[0]}; todo=("${todo[@]:1}")
    [[ -n ${seen[$p]} || -z ${start[$p]} ]] && continue
    seen[$p]=1; all+=("$p"); todo+=(${kids[$p]})
  done
  ((${#all[@]})) || return 0
  for p in "${all[@]}"; do builtin printf 'hermes-proc %s:%s\n' "$p" "${start[$p]}"; done
  [[ $sig == 0 ]] && return 0
  builtin kill -STOP "${all[@]}" 2>/dev/null
  builtin kill "-$sig" "${all[@]}" 2>/dev/null
  builtin kill -CONT "${all[@]}" 2>/dev/null
done
return 0
}
"""

_PROC_RE = re.compile(rb"^hermes-proc (\d+:\d+)$", re.M)


def tree_script(
    sig: str, root: int | None, *, marker: str = "", known: frozenset[str] | set[str] = frozenset()
) -> str:
    """Script that sends ``sig`` (TERM, KILL or 0) to the command's processes.

    ``root``: the command's bash pid in the target (None: found by ``marker``
    alone, ``NAME=value`` in the environment). ``known``: ``pid:starttime``
    entries an earlier call reported. Prints ``hermes-proc pid:starttime`` for
    each process it signals, then ``TREE_DONE``.
    """
    for entry in known:
        if not re.fullmatch(r"\d+:\d+", entry):
            raise ValueError(f"not a pid:starttime entry: {entry!r}")
    if marker and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9]+", marker):
        raise ValueError(f"not a marker NAME=value: {marker!r}")
    sig = {"TERM": "TERM", "KILL": "KILL", "0": "0"}[sig]
    # SIGKILL is repeated until nothing is left (a fork bomb forks between the
    # scan and the stop); the others are sent once.
    rounds = 50 if sig == "KILL" else 1
    args = " ".join([sig, str(int(root)) if root is not None else "-1", str(rounds), marker or "''", *sorted(known)])
    return _TREE_FN + f"__hermes_tree {args}\nbuiltin printf '%s\\n' {TREE_DONE}\n"


def parse_tree_output(out: bytes) -> set[str]:
    """The ``pid:starttime`` entries a run of ``tree_script`` reported."""
    return {m.decode() for m in _PROC_RE.findall(out)}
