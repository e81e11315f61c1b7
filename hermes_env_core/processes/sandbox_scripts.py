"""The bash run inside a target to start, follow, feed and stop a detached process.

Builtins where it matters; the only external programs are mkfifo, tail,
head, wc, and optionally setsid and script(1), all in coreutils/util-linux.
A process's directory holds: ``script`` (what it runs), ``out`` (its output),
``in`` (a FIFO, its stdin), ``wake`` (a FIFO that wakes a waiting poll when it
exits), ``tick`` (a FIFO nobody writes, to sleep on), ``pid`` (its pid and
start time, and the wrapper's), ``exit`` (its exit code, once it ended).
"""

from __future__ import annotations

import shlex

from ..environment.session import ansi_c_quote

__all__ = [
    "DEFAULT_BASE",
    "OPTIONAL_TOOLS",
    "REQUIRED_TOOLS",
    "tools_script",
    "check_script",
    "close_stdin_script",
    "kill_script",
    "launch_script",
    "poll_script",
    "remove_script",
    "resize_script",
    "signal_script",
    "write_script",
]

DEFAULT_BASE = '"${TMPDIR:-/tmp}/hermes-env-bg-$UID"'

#: Programs a background process needs in its target (coreutils). Without setsid a subshell
#: ignoring SIGHUP detaches it; script(1) is needed for ``pty=True`` only.
REQUIRED_TOOLS = ("mkdir", "mkfifo", "tail", "head", "wc")
OPTIONAL_TOOLS = {"setsid": "without it a process is detached by a subshell ignoring SIGHUP",
                  "script": "needed for --pty (util-linux)", "rm": "needed to remove an ended process's files"}


def tools_script(names: tuple[str, ...] = REQUIRED_TOOLS, *, exit_code: int = 0) -> str:
    """Print ``hermes-bg-missing`` and the names of ``names`` not found on PATH, then exit
    ``exit_code`` (0: go on); nothing when all are there."""
    then = f"; exit {int(exit_code)}" if exit_code else ""
    return (
        "__m=; for __t in " + " ".join(shlex.quote(n) for n in names) + "; do "
        'command -v "$__t" >/dev/null 2>&1 || __m+=" $__t"; done; '
        "[ -z \"$__m\" ] || { builtin printf 'hermes-bg-missing%s\\n' \"$__m\"" + then + "; }\n"
    )

# REPLY=start time of pid $1 (field 22 of /proc/PID/stat), and ST=its state;
# fails when there is no such process.
_STAT_FN = r"""__hbg_stat() {
local s; IFS= read -r s <"/proc/$1/stat" 2>/dev/null || return 1
s=${s##*) }; local -a f=($s); ST=${f[0]}; PG=${f[2]}; REPLY=${f[19]}
}
__hbg_alive() { __hbg_stat "$1" && [ "$ST" != Z ] && [ "$REPLY" = "$2" ]; }
"""

# The wrapper: runs the command with stdin from the FIFO and output to the
# log, records pids, waits for it and records its exit code. USR1 closes the
# write end it holds on the FIFO, so the command reads EOF.
_WRAPPER = (
    _STAT_FN
    + r"""d=$1 login=$2 pty=$3
trap 'exec 3>&- 2>/dev/null; __i=1' USR1
exec 3<>"$d/in"
# Started as a job (set -m): a plain `&` would start it with SIGINT and
# SIGQUIT ignored, for good; as a job it also gets a process group of its own.
# script(1) runs its command with $SHELL -c, /bin/sh where unset: exec, so that
# no shell (dash) in the terminal's foreground group turns a Ctrl-C into 130.
set -m
if [ -n "$pty" ]; then
  __hermes_bg_f=$d/script script -qfec "exec bash ${d@Q}/ptyrun" /dev/null <"$d/in" >>"$d/out" 2>&1 3>&- &
else
  __hermes_bg_f=$d/script bash $login -c 'builtin source "$__hermes_bg_f"' <"$d/in" >>"$d/out" 2>&1 3>&- &
fi
c=$!
set +m
# A command that ended at once may be reaped already: start time 0, never signalled.
ct=0; __hbg_stat "$c" && ct=$REPLY; __hbg_stat $$; wt=$REPLY
builtin printf '%s %s %s %s\n' "$c" "$ct" "$$" "$wt" >"$d/pid"
{ builtin printf s >&4; } 4<>"$d/wake"
while :; do __i=; wait "$c"; rc=$?; [ -z "$__i" ] && break; done
# One write of a few bytes: a reader sees the file empty or complete (it tests -s).
builtin printf '%d\n' "$rc" >"$d/exit"
{ builtin printf x >&4; } 4<>"$d/wake"
"""
)

# Runs on the terminal script(1) made; records it and its own pid (which the
# command keeps: exec), the process signals are meant for.
_PTYRUN = """__d=${{__hermes_bg_f%/*}}
tty >"$__d/tty" 2>/dev/null
IFS= read -r __s </proc/$$/stat; __s=${{__s##*) }}; __f=($__s); builtin printf '%s %s\\n' $$ "${{__f[19]}}" >"$__d/inner"
builtin unset -v __d __s __f
stty rows {rows} cols {cols} 2>/dev/null
exec bash {login} -c 'builtin source "$__hermes_bg_f"'
"""


def launch_script(base: str, pid_name: str, script: str, *, login: bool, pty: bool, size: tuple[int, int]) -> str:
    """Create the process's directory, start the wrapper detached, print ``hermes-bg-ok DIR PIDS``."""
    body = "builtin unset -v __hermes_bg_f\n" + script
    lines = [
        tools_script(exit_code=6).rstrip("\n"),
        "umask 077",
        f"b={base}; d=$b/{shlex.quote(pid_name)}",
        (
            '{ mkdir -p -- "$b" && mkdir -- "$d" && mkfifo -- "$d/in" "$d/wake" "$d/tick" && : >"$d/out"; } 2>/dev/null'
            " || { builtin printf 'hermes-bg-error cannot create %s\\n' \"$d\"; exit 3; }"
        ),
        f'builtin printf "%s" {ansi_c_quote(body)} >"$d/script"',
    ]
    if pty:
        runner = _PTYRUN.format(rows=int(size[0]), cols=int(size[1]), login="-l" if login else "")
        lines += [
            "command -v script >/dev/null 2>&1 || { builtin printf 'hermes-bg-error no-script\\n'; exit 4; }",
            f'builtin printf "%s" {ansi_c_quote(runner)} >"$d/ptyrun"',
        ]
    lines += [
        'exec {w}<>"$d/wake"',
        f"W={ansi_c_quote(_WRAPPER)}",
        "a=(hermes-bg \"$d\" " + ("-l" if login else "''") + " " + ("1" if pty else "''") + ")",
        "set -m",  # see the wrapper: signals not ignored
        "if command -v setsid >/dev/null 2>&1; then",
        '  setsid bash -c "$W" "${a[@]}" </dev/null >/dev/null 2>&1 {w}>&- &',
        "else",
        "  (trap '' HUP; exec bash -c \"$W\" \"${a[@]}\") </dev/null >/dev/null 2>&1 {w}>&- &",
        "fi",
        "set +m",
        'IFS= read -r -t 15 -n 1 -u "$w" _',
        'p=; IFS= read -r p <"$d/pid" 2>/dev/null',
        '[ -n "$p" ] || { builtin printf \'hermes-bg-error no-pid\\n\'; exit 5; }',
        "builtin printf 'hermes-bg-ok %s %s\\n' \"$d\" \"$p\"",
    ]
    return "\n".join(lines) + "\n"


# Succeeds when a process in the foreground group of terminal $1 (the group
# of pid $2's terminal) sleeps reading it, and none of that group runs: the
# syscall it sleeps in and its first arguments are in /proc/PID/syscall
# (numbers per architecture, as in processes/inputwait.py).
_WAITING_FN = r"""__hbg_waiting() {
local t=$1 s p n a0 a1 w=0 rd sel pl; local -a f
case $HOSTTYPE in
  x86_64) rd=" 0 17 19 " sel=" 23 270 " pl=" 7 271 ";;
  aarch64) rd=" 63 65 67 " sel=" 72 " pl=" 73 ";;
  *) return 1;;
esac
IFS= read -r s 2>/dev/null <"/proc/$2/stat" || return 1
s=${s##*) }; f=($s); local tp=${f[5]}
for p in /proc/[0-9]*; do
  IFS= read -r s 2>/dev/null <"$p/stat" || continue
  s=${s##*) }; f=($s); [ "${f[2]}" = "$tp" ] || continue
  [ "${f[0]}" = R ] && return 1
  IFS=' ' read -r n a0 a1 _ 2>/dev/null <"$p/syscall" || continue
  case $n in *[!0-9]*|'') continue;; esac
  if [[ $rd == *" $n "* ]]; then [ "$(readlink "$p/fd/$((a0))" 2>/dev/null)" = "$t" ] && w=1
  elif [[ $sel == *" $n "* ]]; then ((a0 == 1)) && [ "$(readlink "$p/fd/0" 2>/dev/null)" = "$t" ] && w=1
  elif [[ $pl == *" $n "* ]]; then ((a1 == 1)) && [ "$(readlink "$p/fd/0" 2>/dev/null)" = "$t" ] && w=1
  fi
done
((w))
}
"""


def poll_script(
    d: str, offset: int, wait_s: float, max_bytes: int, wrapper: tuple[int, int], *, input_check: bool = False
) -> str:
    """Wait up to ``wait_s`` for the exit, then print a status line and the output from ``offset``.

    Status: an exit code; ``-`` while running (``- w`` with ``input_check``
    when the program on its terminal is blocked reading it); ``lost`` when the
    wrapper is gone without recording one; ``gone`` when the directory is.
    """
    q = shlex.quote(d)
    wait = f"{wait_s:.3f}"
    check = (
        _WAITING_FN
        + 'if [ "$rc" = - ]; then t=; IFS= read -r t <"$d/tty" 2>/dev/null; IFS=" " read -r ip _ <"$d/inner" 2>/dev/null\n'
        + '  [ -n "$t" ] && [ -n "$ip" ] && __hbg_waiting "$t" "$ip" 2>/dev/null && rc="- w"\nfi\n'
        if input_check
        else ""
    )
    return (
        _STAT_FN
        + f"d={q}\n"
        + 'exec {w}<>"$d/wake" 2>/dev/null || { builtin printf \'gone\\n\'; exit 0; }\n'
        + (f'[ -s "$d/exit" ] || IFS= read -r -t {wait} -n 1 -u "$w" _\n' if wait_s > 0 else "")
        + "rc=-\n"
        + 'if [ -s "$d/exit" ]; then IFS= read -r rc <"$d/exit"\n'
        + f"elif ! __hbg_alive {int(wrapper[0])} {int(wrapper[1])}; then\n"
        + '  if [ -s "$d/exit" ]; then IFS= read -r rc <"$d/exit"; else rc=lost; fi\n'
        + "fi\n"
        + check
        + "builtin printf '%s\\n' \"$rc\"\n"
        + f'tail -c +{int(offset) + 1} -- "$d/out" 2>/dev/null | head -c {int(max_bytes)}\n'
    )


# Walks /proc once: T=pids of the tree under $1 (plus members of the process
# group $2, when $2 > 1, except $3), S=their start times.
_TREE_FN = r"""__hbg_tree() {
local p s rest q
local -A kids=() start=() grp=() par=()
for p in /proc/[0-9]*; do
  IFS= read -r s <"$p/stat" 2>/dev/null || continue
  rest=${s##*) }; local -a f=($rest); q=${p#/proc/}
  kids[${f[1]}]+=" $q"; start[$q]=${f[19]}; grp[$q]=${f[2]}; par[$q]=${f[1]}
done
local -a todo=("$1"); local -A seen=(); T=(); S=()
# Group members that are not the wrapper's own children: orphans of the tree.
if [ "${2:-0}" -gt 1 ]; then for q in "${!grp[@]}"; do [ "${grp[$q]}" = "$2" ] && [ "${par[$q]}" != "$3" ] && todo+=("$q"); done; fi
while ((${#todo[@]})); do
  p=${todo[0]}; todo=("${todo[@]:1}")
  [ -n "${start[$p]}" ] && [ -z "${seen[$p]}" ] && [ "$p" != "$3" ] || continue
  seen[$p]=1; T+=("$p"); S+=("${start[$p]}"); todo+=(${kids[$p]})
done
}
"""


def kill_script(d: str, pid: tuple[int, int], wrapper: tuple[int, int], grace: float) -> str:
    """TERM the tree (frozen while signalled), KILL what is left after ``grace``; never a reused pid."""
    c, ct = int(pid[0]), int(pid[1])
    w = int(wrapper[0])
    return (
        _STAT_FN
        + _TREE_FN
        + f"d={shlex.quote(d)}\n"
        + f"__hbg_alive {c} {ct} || exit 0\n"
        # The command leads its own process group (a job of the wrapper): members
        # that left the tree (orphans) are still found by it.
        + f'g=0; __hbg_stat {c} && [ "$PG" = {c} ] && g={c}\n'
        + f"__hbg_tree {c} $g {w}\n"
        + "((${#T[@]})) || exit 0\n"
        + 'builtin kill -STOP "${T[@]}" 2>/dev/null; builtin kill -TERM "${T[@]}" 2>/dev/null; '
        + 'builtin kill -CONT "${T[@]}" 2>/dev/null\n'
        + 'if exec {z}<>"$d/tick"; then nap() { IFS= read -r -t 0.02 -u "$z" _; }; else nap() { sleep 0.02; }; fi 2>/dev/null\n'
        + f"n={max(1, int(grace / 0.02))}\n"
        + "while ((n--)); do\n"
        + '  left=0; for i in "${!T[@]}"; do __hbg_alive "${T[i]}" "${S[i]}" && left=1 && break; done\n'
        + "  ((left)) || exit 0\n"
        + "  nap\n"
        + "done\n"
        + 'for i in "${!T[@]}"; do __hbg_alive "${T[i]}" "${S[i]}" && builtin kill -KILL "${T[i]}" 2>/dev/null; done\n'
        + f"__hbg_tree {c} $g {w}\n"
        + '((${#T[@]})) && builtin kill -KILL "${T[@]}" 2>/dev/null\n'
        + "exit 0\n"
    )


def signal_script(d: str, pid: tuple[int, int], sig: int, *, pty: bool = False) -> str:
    """Send ``sig`` to the process (on a PTY: to the command under script(1)), never to a reused pid."""
    lines = _STAT_FN + f"p={int(pid[0])} s={int(pid[1])}\n"
    if pty:
        lines += f'IFS=" " read -r p s <{shlex.quote(d)}/inner 2>/dev/null || exit 3\n'
    return lines + '__hbg_alive "$p" "$s" && builtin kill -' + str(int(sig)) + ' "$p"\nexit 0\n'


def write_script(d: str, data: bytes) -> str:
    """Append ``data`` to the process's stdin FIFO (opened read-write, so the open never blocks)."""
    escaped = "".join(f"\\x{b:02x}" for b in data)
    return (
        f"d={shlex.quote(d)}\n"
        '[ -s "$d/exit" ] && { builtin printf \'exited\\n\'; exit 3; }\n'
        'exec {f}<>"$d/in" 2>/dev/null || exit 4\n'
        f"builtin printf '{escaped}' >&$f\n"
    )


def close_stdin_script(wrapper: tuple[int, int]) -> str:
    w, wt = int(wrapper[0]), int(wrapper[1])
    return _STAT_FN + f"__hbg_alive {w} {wt} && builtin kill -USR1 {w}\nexit 0\n"


def resize_script(d: str, rows: int, cols: int) -> str:
    # The kernel sends SIGWINCH to the terminal's foreground group itself.
    return (
        f"d={shlex.quote(d)}\n"
        't=; IFS= read -r t <"$d/tty" 2>/dev/null; [ -n "$t" ] || exit 3\n'
        f'stty -F "$t" rows {int(rows)} cols {int(cols)} 2>/dev/null\n'
    )


def check_script(d: str, pid: tuple[int, int]) -> str:
    """Print ``alive SIZE``, ``exited RC SIZE``, ``reused``, ``dead`` or ``gone`` for a checkpointed process."""
    c, ct = int(pid[0]), int(pid[1])
    return (
        _STAT_FN
        + f"d={shlex.quote(d)}\n"
        + "[ -d \"$d\" ] || { builtin printf 'gone\\n'; exit 0; }\n"
        + 'n=$(wc -c <"$d/out" 2>/dev/null); n=${n:-0}\n'
        + 'if [ -s "$d/exit" ]; then IFS= read -r rc <"$d/exit"; builtin printf \'exited %s %s\\n\' "$rc" "$n"\n'
        + f"elif __hbg_alive {c} {ct}; then builtin printf 'alive %s\\n' \"$n\"\n"
        + f"elif __hbg_stat {c} && [ \"$ST\" != Z ]; then builtin printf 'reused\\n'\n"
        + "else builtin printf 'dead\\n'; fi\n"
    )


def waiting_script(d: str, quiet_s: float) -> str:
    """Print ``w`` when the PTY process in ``d`` is blocked reading its terminal and silent for ``quiet_s``."""
    return (
        _WAITING_FN
        + f"d={shlex.quote(d)}\n"
        + 't=; IFS= read -r t <"$d/tty" 2>/dev/null; IFS=" " read -r ip _ <"$d/inner" 2>/dev/null\n'
        + '[ -n "$t" ] && [ -n "$ip" ] || exit 0\n'
        + "printf -v now '%(%s)T' -1; m=$(stat -c %Y -- \"$d/out\" 2>/dev/null) || exit 0\n"
        + f"((now - m >= {max(0, int(quiet_s))})) && __hbg_waiting \"$t\" \"$ip\" 2>/dev/null && builtin printf 'w\\n'\n"
        + "exit 0\n"
    )


def remove_script(d: str) -> str:
    return f"rm -rf -- {shlex.quote(d)} 2>/dev/null; exit 0\n"


def read_log_script(d: str, offset: int, max_bytes: int) -> str:
    return f"tail -c +{int(offset) + 1} -- {shlex.quote(d)}/out 2>/dev/null | head -c {int(max_bytes)}\n"


__all__ += ["read_log_script", "waiting_script"]
