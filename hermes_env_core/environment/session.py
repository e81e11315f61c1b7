"""Shell state capture and restore: what makes spawn-per-call feel like one bash.

Each command runs in a fresh ``bash -c``. The wrapper built here restores the
session (variables, functions, aliases, options, cwd) before the command and,
from an EXIT trap, dumps the new state into one framed block on the command's
stdout. Python owns the authoritative copy, so a recreated sandbox gets it back.
"""

from __future__ import annotations

import posixpath
import re
import secrets
import shlex
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_EXCLUDED_PREFIXES",
    "Frame",
    "SessionState",
    "ShellSession",
    "StateParseError",
    "WrappedCommand",
    "kill_tree_script",
    "parse_state_dump",
]

DEFAULT_EXCLUDED_PREFIXES: tuple[str, ...] = ("HERMES_SESSION_",)

# Variables bash owns or re-creates in every process; restoring them is wrong
# (read-only, dynamic, or describing the old process).
_BASH_OWNED = frozenset(
    """
    BASH BASHOPTS BASHPID BASH_ALIASES BASH_ARGC BASH_ARGV BASH_ARGV0 BASH_CMDS
    BASH_COMMAND BASH_EXECUTION_STRING BASH_LINENO BASH_LOADABLES_PATH BASH_REMATCH
    BASH_SOURCE BASH_SUBSHELL BASH_VERSINFO BASH_VERSION BASH_MONOSECONDS
    BASH_TRAPSIG COLUMNS COMP_WORDBREAKS DIRSTACK EPOCHREALTIME EPOCHSECONDS EUID
    FUNCNAME GROUPS HISTCMD HOSTNAME HOSTTYPE LINENO LINES MACHTYPE OPTERR OPTIND
    OSTYPE PIPESTATUS PPID PWD RANDOM SECONDS SHELLOPTS SHLVL SRANDOM UID _
    """.split()
)
# shopt options that cannot be set, and set -o options that only make sense
# in an interactive shell.
_UNSETTABLE_SHOPT = frozenset({"login_shell", "restricted_shell"})
_SKIP_SETO = frozenset({"emacs", "vi", "history", "monitor"})

_DECL_RE = re.compile(r"declare -([-a-zA-Z]+) ([A-Za-z_][A-Za-z0-9_]*)")
_MARK = b"\x1e"


class StateParseError(ValueError):
    """A state dump is incomplete or not in the expected shape."""


@dataclass(frozen=True)
class SessionState:
    """One captured shell state. Immutable, so readers never see it torn."""

    variables: dict[str, str] = field(default_factory=dict)  # name -> declare line
    functions: str = ""
    aliases: str = ""
    shellopts: frozenset[str] = frozenset()
    bashopts: frozenset[str] = frozenset()
    all_seto: frozenset[str] = frozenset()
    all_shopt: frozenset[str] = frozenset()
    umask: str | None = None
    cwd: str | None = None

    @property
    def exported(self) -> dict[str, str]:
        return {n: line for n, line in self.variables.items() if "x" in _flags(line)}


def _flags(line: str) -> str:
    m = _DECL_RE.match(line)
    return m.group(1) if m else ""


def _keep_var(name: str, prefixes: Sequence[str]) -> bool:
    if name in _BASH_OWNED or name.startswith("__hermes_"):
        return False
    return not any(name.startswith(p) for p in prefixes)


# declare lines repeat from one command to the next: remember each line's verdict.
_LINE_CACHE: dict[tuple[str, tuple[str, ...]], str | None] = {}


def _parse_variables(var_text: str, prefixes: Sequence[str]) -> dict[str, str]:
    prefixes = tuple(prefixes)
    cache = _LINE_CACHE
    if len(cache) > 20000:
        cache.clear()
    variables: dict[str, str] = {}
    for line in var_text.split("\n"):
        if not line:
            continue
        key = (line, prefixes)
        try:
            name = cache[key]
        except KeyError:
            m = _DECL_RE.match(line)
            if m is None:
                raise StateParseError(f"unexpected line in variable dump: {line[:80]!r}") from None
            n = m.group(2)
            name = n if n == "BASHOPTS" or _keep_var(n, prefixes) else None
            cache[key] = name
        if name is not None:
            variables[name] = line
    return variables


def parse_state_dump(
    dump: str, sep: str, prefixes: Sequence[str], cwd: str | None, names_from: SessionState | None = None
) -> SessionState:
    """Parse what the EXIT trap wrote. Raises StateParseError when incomplete.

    A full dump (a snapshot) also lists every option name; a per-command dump
    takes those lists from ``names_from``.
    """
    parts = dump.split(sep + "\n")
    if len(parts) != 6 or parts[5] != "":
        raise StateParseError(f"state dump has {len(parts) - 1} of 5 sections")
    var_text, func_text, alias_text, opt_text, full_text = parts[:5]
    variables = dict(_parse_variables(var_text, prefixes))
    bashopts_line = variables.pop("BASHOPTS", "")
    bashopts = frozenset(filter(None, bashopts_line.partition("=")[2].strip('"').split(":")))
    opt_lines = opt_text.split("\n")
    if len(opt_lines) < 3 or not opt_lines[0].startswith("umask "):
        raise StateParseError("option section is incomplete")
    if full_text:
        lines = full_text.splitlines()
        all_seto = frozenset(ln.split()[-1] for ln in lines if ln.startswith("set "))
        all_shopt = frozenset(ln.split()[-1] for ln in lines if ln.startswith("shopt "))
    elif names_from is not None:
        all_seto, all_shopt = names_from.all_seto, names_from.all_shopt
    else:
        raise StateParseError("no option names to interpret the state with")
    return SessionState(
        variables=variables,
        functions=func_text,
        aliases=alias_text,
        shellopts=frozenset(filter(None, opt_lines[1].split(":"))),
        bashopts=bashopts,
        all_seto=all_seto,
        all_shopt=all_shopt,
        umask=opt_lines[0].split()[-1],
        cwd=cwd,
    )


# The trap body, on one line (see ``wrap``). Only builtins, no forks: every
# external process here would cost about a millisecond per command.
# ``builtin`` guards against user functions or aliases named like them.
_SAVE_FN = (
    "__hermes_save() { "
    "builtin unset -f __hermes_save; "
    "builtin unset -v BASH_EXECUTION_STRING 2>/dev/null; "
    "{ builtin declare -p; builtin printf '%s\\n' \"$__hermes_sep\"; "
    "builtin declare -f; builtin printf '%s\\n' \"$__hermes_sep\"; "
    "builtin alias -p; builtin printf '%s\\n' \"$__hermes_sep\"; "
    "builtin umask -p; builtin printf '%s\\n%s\\n' \"$__hermes_so\" \"$__hermes_sep\"; "
    "if [ -n \"$__hermes_full\" ]; then builtin set +o; builtin shopt -p; fi; "
    "builtin printf '%s\\n' \"$__hermes_sep\"; } >\"$__hermes_f\" 2>/dev/null; "
    "local __hermes_s= __hermes_d=$PWD; "
    "[ -n \"$__hermes_nocd\" ] && __hermes_d=; "
    "LC_ALL=C; "
    "if [ -n \"$__hermes_local\" ]; then "
    "builtin printf '\\036%s:S%d %d 0 2\\037%s\\036%s:E\\n' \"$__hermes_n\" \"$__hermes_rc\" \"${#__hermes_d}\" "
    "\"$__hermes_d\" \"$__hermes_n\" >&\"$__hermes_o\"; return; fi; "
    "IFS= builtin read -r -d '' __hermes_s <\"$__hermes_f\"; "
    "local __hermes_e=0; "
    # bash's stdout is line-buffered: with no newline before its end (the
    # header ends in 0x1f) the frame leaves in one write, or a few large ones.
    "if [[ $__hermes_s != *$'\\037'* ]]; then __hermes_s=${__hermes_s//$'\\n'/$'\\037'}; __hermes_e=1; fi; "
    "builtin printf '\\036%s:S%d %d %d %d\\037%s%s\\036%s:E\\n' \"$__hermes_n\" \"$__hermes_rc\" \"${#__hermes_d}\" "
    "\"${#__hermes_s}\" \"$__hermes_e\" \"$__hermes_d\" \"$__hermes_s\" \"$__hermes_n\" >&\"$__hermes_o\"; "
    "}"
)


@dataclass(frozen=True)
class Frame:
    """What the wrapper reported about itself on the output stream."""

    exit_code: int
    cwd: str
    state_text: str


@dataclass
class WrappedCommand:
    """One generated script and the keys needed to read its output back."""

    script: str
    nonce: str
    sep: str
    slot: int
    explicit_cwd: bool
    cwd: str | None
    state_file: str = ""

    @property
    def pidfile(self) -> str:
        """Where the wrapper records ``<pid> <nonce>`` (with ``record_pid``)."""
        return self.state_file + ".pid"

    def pid_from(self, text: str) -> int | None:
        """The pid in a pidfile's text, if this command (not an earlier one in the slot) wrote it."""
        parts = text.split()
        if len(parts) == 2 and parts[1] == self.nonce and parts[0].isdigit():
            return int(parts[0])
        return None

    @property
    def marker(self) -> bytes:
        return _MARK + self.nonce.encode() + b":"


class ShellSession:
    """Holds the session state of one environment and wraps commands.

    Thread-safe: concurrent commands each restore the state current when they
    start; whichever finishes last wins, and a state is replaced whole.
    """

    def __init__(
        self,
        *,
        state_dir: str,
        default_cwd: str | None = None,
        excluded_prefixes: Iterable[str] = DEFAULT_EXCLUDED_PREFIXES,
        env_id: str | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.excluded_prefixes = tuple(excluded_prefixes)
        self.env_id = env_id or secrets.token_hex(4)
        self._lock = threading.Lock()
        self._baseline: SessionState | None = None
        self._state: SessionState | None = None
        self._cwd = default_cwd
        self._default_cwd = default_cwd
        self._free_slots: list[int] = []
        self._next_slot = 0

    # -- state -----------------------------------------------------------
    @property
    def state(self) -> SessionState | None:
        return self._state

    @property
    def cwd(self) -> str | None:
        return self._cwd

    @property
    def baseline(self) -> SessionState | None:
        return self._baseline

    def set_baseline(self, state: SessionState) -> None:
        with self._lock:
            self._baseline = state

    def set_state(self, state: SessionState) -> None:
        with self._lock:
            self._state = state
            if state.cwd:
                self._cwd = state.cwd
            if self._default_cwd is None and state.cwd:
                self._default_cwd = state.cwd

    def reset_cwd(self) -> str | None:
        """After the session's directory vanished: back to the default, or,
        if that is the one that failed, to where the shell starts."""
        with self._lock:
            start = self._baseline.cwd if self._baseline else None
            self._cwd = start if self._cwd == self._default_cwd and start else self._default_cwd
            return self._cwd

    # -- wrapping --------------------------------------------------------
    def wrap(self, command: str, *, cwd: str | None = None, stdin_heredoc: bytes | None = None,
             snapshot: bool = False, record_pid: bool = False, state_in_file: bool = False) -> WrappedCommand:
        """Build the script for one command (``snapshot``: capture only, no restore).

        ``state_in_file``: the caller can read ``state_file`` itself (the target
        shares its filesystem), so the frame carries only exit code and cwd.
        """
        nonce = secrets.token_hex(12)
        sep = f"#hermes-state:{nonce}"
        with self._lock:
            state = None if snapshot else self._state
            baseline = self._baseline
            session_cwd = self._cwd
            new_slot = not self._free_slots
            slot = self._take_slot() if new_slot else self._free_slots.pop()
        explicit = cwd is not None
        # A snapshot runs where the shell starts: that is how we learn it.
        target_cwd = None if snapshot and not explicit else _resolve_cwd(session_cwd, cwd)
        state_file = posixpath.join(self.state_dir, f".hermes-{self.env_id}-{slot}.state")
        parts = [
            _SAVE_FN,
            f"__hermes_n={nonce}; __hermes_sep='{sep}'; __hermes_f={shlex.quote(state_file)}; "
            f"__hermes_nocd= __hermes_full={'1' if snapshot else ''} __hermes_local={'1' if state_in_file else ''}",
            "trap '{ __hermes_rc=$? __hermes_so=$SHELLOPTS; builtin set +eux +o pipefail; } 2>/dev/null; __hermes_save' EXIT",
            "exec {__hermes_o}>&1 2>&1",
        ]
        if new_slot:
            # Created once per slot in a subshell, so the user's umask is untouched.
            parts.append('( builtin umask 077; : >"$__hermes_f" ) 2>/dev/null')
        if record_pid:
            parts.append(pidfile_line().rstrip("\n"))
        last: list[str] = []
        if state is not None:
            early, last = self._option_lines(state, baseline)
            parts += early  # shopt first: extglob and friends change how functions parse
            parts += self._restore_lines(state, baseline)
        if target_cwd:
            parts.append(_cd_line(target_cwd, "__hermes_nocd=1; "))
        parts += last  # set -o last, xtrace at the very end: nothing of ours is traced
        body = _with_heredoc(command, stdin_heredoc) if stdin_heredoc is not None else command
        script = _one_line(parts) + "\n" + body + "\n"
        return WrappedCommand(script, nonce, sep, slot, explicit, target_cwd, state_file)

    def _take_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def release(self, wrapped: WrappedCommand) -> None:
        with self._lock:
            self._free_slots.append(wrapped.slot)

    def _restore_lines(self, state: SessionState, baseline: SessionState | None) -> list[str]:
        """Restore statements: one per variable (never spanning lines), then
        functions and aliases as one multi-line part."""
        base_vars = baseline.variables if baseline else {}
        out = [line for name, line in state.variables.items() if base_vars.get(name) != line]
        removed = [n for n in base_vars if n not in state.variables]
        if removed:
            out.append("builtin unset -v " + " ".join(removed) + " 2>/dev/null")
        defs = state.functions + ("\n" if state.functions and not state.functions.endswith("\n") else "")
        defs += state.aliases
        if defs.strip():
            out.append(defs if "\n" in defs.rstrip("\n") else defs + "\n")
        return out

    def _option_lines(self, state: SessionState, baseline: SessionState | None) -> tuple[list[str], list[str]]:
        """(umask and shopt statements, set -o statements)."""
        text = self._options_text(state, baseline)
        early = [ln for ln in text.splitlines() if ln.startswith(("builtin umask", "builtin shopt"))]
        late = [ln for ln in text.splitlines() if ln.startswith("builtin set ")]
        return early, late

    def restore_script(self, command: str, *, cwd: str | None = None) -> str:
        """``command`` preceded by the session's state and directory, with no
        state capture: for processes started outside ``execute()``. A
        directory that cannot be entered exits 126 naming it."""
        with self._lock:
            state, baseline, session_cwd = self._state, self._baseline, self._cwd
        parts: list[str] = []
        last: list[str] = []
        if state is not None:
            early, last = self._option_lines(state, baseline)
            parts += early + self._restore_lines(state, baseline)
        target = _resolve_cwd(session_cwd, cwd)
        if target:
            parts.append(_cd_line(target))
        parts += last
        return (_one_line(parts) + "\n" if parts else "") + command + "\n"

    def _options_text(self, state: SessionState, baseline: SessionState | None) -> str:
        base_so = baseline.shellopts if baseline else frozenset()
        base_bo = baseline.bashopts if baseline else frozenset()
        on_so = sorted((state.shellopts - base_so) - _SKIP_SETO)
        off_so = sorted(((base_so - state.shellopts) & state.all_seto) - _SKIP_SETO)
        on_bo = sorted((state.bashopts - base_bo) - _UNSETTABLE_SHOPT)
        off_bo = sorted(((base_bo - state.bashopts) & state.all_shopt) - _UNSETTABLE_SHOPT)
        # LINENO=0 makes bash's messages read like an interactive shell's
        # ("bash: x: command not found"), without our wrapper's line numbers.
        out = "LINENO=0\n"
        if state.umask and state.umask != (baseline.umask if baseline else None):
            out += f"builtin umask {state.umask}\n"
        if on_bo:
            out += "builtin shopt -s " + " ".join(on_bo) + "\n"
        if off_bo:
            out += "builtin shopt -u " + " ".join(off_bo) + "\n"
        # xtrace last, so that nothing of ours is traced.
        flags = [f"+o {o}" for o in off_so] + [f"-o {o}" for o in on_so if o != "xtrace"]
        if "xtrace" in on_so:
            flags.append("-o xtrace")
        if flags:
            out += "builtin set " + " ".join(flags) + "\n"
        return out

    def interactive_defaults(self, state: SessionState) -> SessionState:
        """The first state: aliases expanded, as in an interactive bash, and
        the configured directory (the snapshot itself ran where bash starts)."""
        return SessionState(
            **{
                **state.__dict__,
                "bashopts": state.bashopts | {"expand_aliases"},
                "cwd": self._default_cwd or state.cwd,
            }
        )

    # -- reading back ----------------------------------------------------
    def accept(self, wrapped: WrappedCommand, frame: Frame | None, *, as_baseline: bool = False) -> SessionState | None:
        """Install the state a finished command reported; None if it reported none."""
        if frame is None:
            return None
        state = parse_state_dump(
            frame.state_text, wrapped.sep, self.excluded_prefixes, frame.cwd or None, names_from=self._baseline
        )
        if as_baseline:
            self.set_baseline(state)
            return state
        if wrapped.explicit_cwd:
            # A one-off cwd does not move the session.
            state = SessionState(**{**state.__dict__, "cwd": self._cwd})
        self.set_state(state)
        return state


def _resolve_cwd(session_cwd: str | None, cwd: str | None) -> str | None:
    """``cwd`` (a relative one against the session's), else the session's own."""
    if cwd is None:
        return session_cwd
    if session_cwd and not posixpath.isabs(cwd) and not cwd.startswith("~"):
        return posixpath.join(session_cwd, cwd)
    return cwd


def _cd_line(path: str, on_fail: str = "") -> str:
    q = _quote_dir(path)
    return (
        f"builtin cd -- {q} 2>/dev/null || {{ {on_fail}"
        f"builtin printf 'hermes-env: cannot enter working directory: %s\\n' {q}; exit 126; }}"
    )


def _one_line(parts: list[str]) -> str:
    """Join statements into one physical line, so the command after it is
    numbered as in a plain ``bash -c`` whatever the size of the state (bash's
    messages say "line N"). Only text spanning lines (function bodies,
    aliases) goes through eval; the rest is parsed once."""
    return "; ".join(p if "\n" not in p else "builtin eval " + ansi_c_quote(p) for p in parts)


def _quote_dir(path: str) -> str:
    """Quote a directory for ``cd``, expanding a leading ``~`` to the target's $HOME."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def ansi_c_quote(text: str) -> str:
    """Quote ``text`` as one bash ``$'...'`` word with no raw newline in it."""
    return "$'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


_UNSAFE_IN_HEREDOC = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _with_heredoc(command: str, data: bytes) -> str:
    """Feed ``data`` to ``command`` through a heredoc whose delimiter is not in it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    # bash mangles its internal quoting bytes (\001, \177) and cannot hold NUL:
    # such data travels base64-encoded.
    if text is None or _UNSAFE_IN_HEREDOC.search(text):
        import base64

        body = base64.encodebytes(data).decode("ascii")
        delim = _delimiter(body)
        return f"{{\n{command}\n}} < <(base64 -d <<'{delim}'\n{body}{delim}\n)"
    delim = _delimiter(text)
    if text == "" or text.endswith("\n"):
        return f"{{\n{command}\n}} <<'{delim}'\n{text}{delim}\n"
    # A heredoc always ends in a newline; strip the one we had to add.
    return (
        f"{{\n{command}\n}} < <(IFS= builtin read -r -d '' __hermes_in <<'{delim}'\n{text}\n{delim}\n"
        f"builtin printf '%s' \"${{__hermes_in%$'\\n'}}\")"
    )


def _delimiter(text: str) -> str:
    lines = set(text.split("\n"))
    while True:
        delim = "HERMES_EOF_" + secrets.token_hex(8)
        if delim not in lines:
            return delim


# Ends a process tree inside a target where we can only run another command:
# walks /proc by parent pid (bash builtins only), stops the tree so it cannot
# fork away, signals it, then lets it run to receive the signal.
KILL_TREE_FN = r"""__hermes_kill_tree() {
local sig=$1 root=$2 p s pp rest
local -A kids=()
for p in /proc/[0-9]*; do
  IFS= read -r s <"$p/stat" 2>/dev/null || continue
  rest=${s##*) }; rest=${rest#* }; pp=${rest%% *}
  kids[$pp]+=" ${p#/proc/}"
done
local -a todo=("$root") all=()
while ((${#todo[@]})); do
  p=${todo[0]}; todo=("${todo[@]:1}"); all+=("$p")
  todo+=(${kids[$p]})
done
builtin kill -STOP "${all[@]}" 2>/dev/null
builtin kill "-$sig" "${all[@]}" 2>/dev/null
builtin kill -CONT "${all[@]}" 2>/dev/null
return 0
}
"""


def kill_tree_script(pid: int, sig: str = "TERM") -> str:
    """A bash script that sends ``sig`` to ``pid`` and all its descendants."""
    return f"{KILL_TREE_FN}__hermes_kill_tree {shlex.quote(sig)} {int(pid)}\n"


def pidfile_line(path_expr: str = '"$__hermes_f.pid"') -> str:
    """Script line recording the wrapper's pid and nonce for a later ``kill_tree_script``."""
    return f"builtin printf '%d %s' $$ \"$__hermes_n\" >{path_expr}\n"
