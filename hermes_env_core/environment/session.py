"""Shell state capture and restore: what makes spawn-per-call feel like one bash.

Each command runs in a fresh bash. The wrapper built here restores the session
(variables, functions, aliases, options, traps, limits, hashed paths, cwd,
OLDPWD, the directory stack, ``$?`` and ``$_``) before the command and dumps the
new state into one framed block on the output stream after it. Python owns the
authoritative copy, so a recreated target gets it back. The wrapper text itself
travels privately (see ``shellscript.stub``); it is never on a command line.
"""

from __future__ import annotations

import posixpath
import re
import secrets
import shlex
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .shellscript import (
    OUT_FD,
    SECTIONS,
    ansi_c_quote,
    capture_line,
    cd_line,
    epilogue,
    script_stub,
    exit_trap,
    one_line,
    quote_dir,
    ret_function,
    save_function,
    stdin_statement,
    stub,
)

__all__ = [
    "DEFAULT_EXCLUDED_PREFIXES",
    "CommandError",
    "Frame",
    "SessionState",
    "ShellSession",
    "StateParseError",
    "WrappedCommand",
    "ansi_c_quote",
    "check_command",
    "kill_tree_script",
    "parse_state_dump",
]

DEFAULT_EXCLUDED_PREFIXES: tuple[str, ...] = ("HERMES_SESSION_",)

# Variables bash owns or re-creates in every process; restoring them is wrong
# (read-only, dynamic, or describing the old process). OLDPWD and DIRSTACK are
# restored apart, after the cd.
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
_SPECIAL = frozenset({"BASHOPTS", "DIRSTACK", "__hermes_l", "__hermes_r"})
# shopt options that cannot be set, and set -o options that only make sense
# in an interactive shell.
_UNSETTABLE_SHOPT = frozenset({"login_shell", "restricted_shell"})
_SKIP_SETO = frozenset({"emacs", "vi", "history", "monitor"})
# Traps that would fire on the wrapper's own statements: applied last.
_LATE_TRAPS = frozenset({"DEBUG", "ERR", "RETURN"})

_DECL_RE = re.compile(r"declare -([-a-zA-Z]+) ([A-Za-z_][A-Za-z0-9_]*)")
_TRAP_RE = re.compile(r"trap -- ('(?:[^']|'\\'')*') (\S+)\n")
_FUNC_HEAD_RE = re.compile(r"^(\S+) \(\) $", re.M)
_ULIMIT_RE = re.compile(r"\(.*-([A-Za-z])\) (\S+)$")
_MARK = b"\x1e"
# A command that may end the shell early (exit, exec, errexit...) gets the
# EXIT trap that saves the state then; others do not, so `trap -p` shows only
# the user's traps.
_MAY_EXIT_RE = re.compile(
    r"\b(exit|exec|logout|source|eval|suspend)\b|(^|[\s;&|(`])\.\s"
    r"|\bset\b[^\n;|&]*(\s-[a-zA-Z]*e|errexit)"
)


_XTRACE_RE = re.compile(r"\bset\b[^\n;|&]*(\s-[a-zA-Z]*x|xtrace)|\bxtrace\b")


class StateParseError(ValueError):
    """A state dump is incomplete or not in the expected shape."""


class CommandError(ValueError):
    """A command that cannot be run as given (it names the problem)."""


def check_command(command: str) -> None:
    """Raise ``CommandError`` for a command bash cannot run as typed (a NUL byte)."""
    if not isinstance(command, str):
        raise CommandError(f"command must be a str, not {type(command).__name__}: {command!r:.80}")
    i = command.find("\x00")
    if i >= 0:
        raise CommandError(
            f"command contains a NUL byte at offset {i} ({command[max(0, i - 20):i + 20]!r}); "
            "bash cannot hold NUL in a command: pass binary data through stdin instead"
        )


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
    #: ``trap -- '...' SIG`` statements of the user's traps, EXIT apart
    traps: tuple[tuple[str, str], ...] = ()
    exit_trap: str | None = None  # the user's EXIT trap body
    last_status: int = 0
    last_arg: str | None = None  # a bash word (declare -p quoting) for ``$_``
    dirstack: str | None = None  # the ``(...)`` of ``declare -a DIRSTACK``
    ulimits: tuple[tuple[str, str, str], ...] = ()  # (flag, soft, hard)
    hashes: str = ""
    jobs: int = 0
    fds: tuple[int, ...] = ()
    dir_recreated: bool = False
    #: CPU seconds (user, system) of the command's shell and every process it waited for,
    #: from bash's ``times``; None when they were not read in the shell itself
    cpu_times: tuple[float, float] | None = None

    @property
    def exported(self) -> dict[str, str]:
        return {n: line for n, line in self.variables.items() if "x" in _flags(line)}

    @property
    def function_names(self) -> tuple[str, ...]:
        return tuple(_FUNC_HEAD_RE.findall(self.functions))


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
            name = n if n in _SPECIAL or _keep_var(n, prefixes) else None
            cache[key] = name
        if name is not None:
            variables[name] = line
    return variables


def _strip_own_functions(text: str) -> str:
    """``declare -f`` output without the wrapper's own functions."""
    if "__hermes_" not in text:
        return text
    out: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        m = _FUNC_HEAD_RE.match(line.rstrip("\n"))
        if m:
            skipping = m.group(1).startswith("__hermes_")
        if not skipping:
            out.append(line)
        elif line == "}\n" or line == "}":
            skipping = False
    return "".join(out)


def _dq_value(line: str) -> str:
    """The value of a ``declare -- NAME="digits"`` line (anything else may come back quoted)."""
    return line.partition("=")[2].strip('"')


def _sq_unquote(word: str) -> str:
    """The text of a ``'...'`` word as ``trap -p`` prints it."""
    return word[1:-1].replace("'\\''", "'")


def _parse_ulimits(soft: str, hard: str) -> tuple[tuple[str, str, str], ...]:
    def table(text: str) -> dict[str, str]:
        out = {}
        for line in text.splitlines():
            m = _ULIMIT_RE.search(line)
            if m:
                out[m.group(1)] = m.group(2)
        return out

    s, h = table(soft), table(hard)
    return tuple((flag, s[flag], h.get(flag, s[flag])) for flag in sorted(s))


def parse_state_dump(
    dump: str,
    sep: str,
    prefixes: Sequence[str],
    cwd: str | None,
    names_from: SessionState | None = None,
    *,
    status: int | None = None,
) -> SessionState:
    """Parse what the save wrote. Raises StateParseError when incomplete.

    A full dump (a snapshot) also lists every option name; a per-command dump
    takes those lists from ``names_from``.
    """
    parts = dump.split(sep + "\n")
    if len(parts) != len(SECTIONS) + 1 or parts[-1] != "":
        raise StateParseError(f"state dump has {len(parts) - 1} of {len(SECTIONS)} sections")
    sec = dict(zip(SECTIONS, parts))
    variables = dict(_parse_variables(sec["vars"], prefixes))
    bashopts_line = variables.pop("BASHOPTS", "")
    bashopts = frozenset(filter(None, bashopts_line.partition("=")[2].strip('"').split(":")))
    last = variables.pop("__hermes_l", None)
    dirs = variables.pop("DIRSTACK", None)
    if status is None:
        # The session server keeps the last command's status in __hermes_r between commands.
        kept = _dq_value(variables.pop("__hermes_r", ""))
        status = int(kept) if kept.isdigit() else 0
    else:
        variables.pop("__hermes_r", None)
    opt_lines = sec["opts"].split("\n")
    if len(opt_lines) < 3 or not opt_lines[0].startswith("umask "):
        raise StateParseError("option section is incomplete")
    if sec["full"]:
        lines = sec["full"].splitlines()
        all_seto = frozenset(ln.split()[-1] for ln in lines if ln.startswith("set "))
        all_shopt = frozenset(ln.split()[-1] for ln in lines if ln.startswith("shopt "))
    elif names_from is not None:
        all_seto, all_shopt = names_from.all_seto, names_from.all_shopt
    else:
        raise StateParseError("no option names to interpret the state with")
    traps: list[tuple[str, str]] = []
    exit_body: str | None = None
    for m in _TRAP_RE.finditer(sec["traps"]):
        if m.group(2) == "EXIT":
            exit_body = _sq_unquote(m.group(1))
        else:
            traps.append((m.group(2), m.group(0).rstrip("\n")))
    left = sec["left"].split("\n")
    fds = tuple(int(x) for x in left[0][3:].split() if x.isdigit()) if left and left[0].startswith("fds") else ()
    return SessionState(
        variables=variables,
        functions=_strip_own_functions(sec["funcs"]),
        aliases=sec["aliases"],
        shellopts=frozenset(filter(None, opt_lines[1].split(":"))),
        bashopts=bashopts,
        all_seto=all_seto,
        all_shopt=all_shopt,
        umask=opt_lines[0].split()[-1],
        cwd=cwd,
        traps=tuple(traps),
        exit_trap=exit_body,
        last_status=status,
        last_arg=last.partition("=")[2] if last else None,
        dirstack=dirs.partition("=")[2] if dirs else None,
        ulimits=_parse_ulimits(sec["soft"], sec["hard"]),
        hashes=sec["hash"],
        jobs=len(sec["jobs"].split()),
        fds=fds,
        dir_recreated=len(left) > 1 and left[1] == "recreated",
        cpu_times=_parse_times(sec["times"]),
    )


_TIME_RE = re.compile(r"(\d+)m([\d.]+)s")


def _parse_times(text: str) -> tuple[float, float] | None:
    """``$$ $BASHPID`` and bash's ``times`` (own user/system, then its children's) -> (user, system).

    Read in a subshell (``$BASHPID`` differs), the figures are the subshell's: None.
    """
    lines = text.splitlines()
    if len(lines) < 3:
        return None
    pids = lines[0].split()
    if len(pids) != 2 or pids[0] != pids[1]:
        return None
    try:
        own = [int(m) * 60 + float(s) for m, s in _TIME_RE.findall(lines[1])]
        kids = [int(m) * 60 + float(s) for m, s in _TIME_RE.findall(lines[2])]
    except ValueError:
        return None
    if len(own) != 2 or len(kids) != 2:
        return None
    return own[0] + kids[0], own[1] + kids[1]


@dataclass(frozen=True)
class Frame:
    """What the wrapper reported about itself on the output stream."""

    exit_code: int
    cwd: str
    state_text: str | None


@dataclass
class WrappedCommand:
    """One generated script and the keys needed to read its output back.

    ``script`` is the constant ``bash -c`` argument; ``payload`` is the private
    script it reads (from stdin, or from ``private_path`` when the backend
    places files). ``exit_trap_text`` tells whether the EXIT trap was ours.
    """

    script: str
    nonce: str
    sep: str
    slot: int
    explicit_cwd: bool
    cwd: str | None
    state_file: str = ""
    payload: bytes = b""
    private_path: str | None = None
    pid_token: str = ""

    @property
    def pidfile(self) -> str:
        """Where the wrapper records ``<pid> <token>`` (with ``record_pid``)."""
        return self.state_file + ".pid"

    def pid_from(self, text: str) -> int | None:
        """The pid in a pidfile's text, if this command (not an earlier one in the slot) wrote it."""
        parts = text.split()
        if len(parts) == 2 and parts[1] == self.pid_token and parts[0].isdigit():
            return int(parts[0])
        return None

    @property
    def marker(self) -> bytes:
        return _MARK + self.nonce.encode() + b":"


def may_exit(command: str, state: SessionState | None) -> bool:
    """Whether ``command`` may end its shell before the wrapper's epilogue
    (exit, exec, errexit, a signal to itself, a sourced file or a function that does)."""
    if _MAY_EXIT_RE.search(command):
        return True
    if state is None:
        return False
    if "errexit" in state.shellopts:
        return True
    if state.functions and _MAY_EXIT_RE.search(state.functions):
        return any(re.search(rf"(^|[^\w-]){re.escape(n)}($|[^\w-])", command) for n in state.function_names)
    return False


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
        self._file_id = re.sub(r"[^A-Za-z0-9_.-]", "_", self.env_id)[:40]
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

    def note_cwd(self, cwd: str) -> None:
        """The session's directory as its server reported it after a command."""
        with self._lock:
            self._cwd = cwd

    def reset_cwd(self) -> str | None:
        """After the session's directory vanished: back to the default, or,
        if that is the one that failed, to where the shell starts."""
        with self._lock:
            start = self._baseline.cwd if self._baseline else None
            self._cwd = start if self._cwd == self._default_cwd and start else self._default_cwd
            return self._cwd

    def take_exit_trap(self) -> str | None:
        """The user's EXIT trap, removed from the state (it runs once, at close)."""
        with self._lock:
            state = self._state
            if state is None or not state.exit_trap:
                return None
            self._state = SessionState(**{**state.__dict__, "exit_trap": None})
            return state.exit_trap

    # -- wrapping --------------------------------------------------------
    def wrap(
        self,
        command: str,
        *,
        cwd: str | None = None,
        stdin: bytes | None = None,
        snapshot: bool = False,
        record_pid: bool = False,
        channel: str = "stdin",
        preamble: str = "",
        login: bool = False,
    ) -> WrappedCommand:
        """Build the script for one command (``snapshot``: capture only, no restore).

        ``channel`` says how the private script reaches bash: ``stdin`` (the
        backend feeds ``payload`` to bash's stdin), ``file`` (the backend writes
        ``payload`` to ``private_path``, 0600, before starting bash) or
        ``inline`` (on the command line: only for backends that can do neither).
        ``stdin`` is the command's own input, delivered inside the script.
        ``preamble``: statements run first (a backend's configured exports).
        """
        check_command(command)
        nonce = secrets.token_hex(12)
        sep = f"#hermes-state:{nonce}"
        with self._lock:
            state = None if snapshot else self._state
            baseline = self._baseline
            session_cwd = self._cwd
            slot = self._free_slots.pop() if self._free_slots else self._take_slot()
        explicit = cwd is not None
        # A snapshot runs where the shell starts: that is how we learn it.
        target_cwd = None if snapshot and not explicit else _resolve_cwd(session_cwd, cwd)
        base = posixpath.join(self.state_dir, f".hermes-{self._file_id}-{slot}")
        state_file = base + ".state"
        private_path = base + ".in" if channel == "file" else None
        pid_token = secrets.token_hex(8)
        script_mode = (
            not snapshot and state is not None
            and ("xtrace" in state.shellopts or _XTRACE_RE.search(command) is not None)
        )
        parts = ["builtin unset -v __hermes_c __hermes_u __hermes_n BASH_EXECUTION_STRING 2>/dev/null"]
        if private_path:
            parts.append(f"builtin : >|{shlex.quote(private_path)}")
        parts.append(f"exec {OUT_FD}>&1 2>&1")
        if preamble:
            parts.append(preamble)
        if record_pid:
            pf = shlex.quote(state_file + ".pid")
            parts.append(
                f"{{ [ -e {pf} ] || [ -L {pf} ] || (builtin umask 077; : >|{pf}); "
                f"[ -f {pf} ] && [ ! -L {pf} ] && builtin printf '%d %s' $$ {pid_token} >|{pf}; }} 2>/dev/null"
            )
        save_fn = save_function(nonce=nonce, sep=sep, state_dir=self.state_dir, state_file=state_file)
        late = ""
        if snapshot:
            parts.append("__hermes_full=1")
        if state is not None:
            early, late = self._restore(state, baseline, script_mode)
            parts += early
        if not snapshot and may_exit(command, state):
            parts.append(exit_trap(save_fn, state.exit_trap if state else None))
        elif state is not None and state.exit_trap:
            parts.append(f"builtin trap -- {shlex.quote(state.exit_trap)} EXIT")
        where: list[str] = []  # the cd and what a cd changes
        if target_cwd:
            where.append(cd_line(target_cwd, nonce))
        if state is not None:
            where += _after_cd(state)
        if script_mode:
            assert state is not None
            # bash reads the command as its script (exact xtrace prefix and
            # messages); __hermes_ret switches stdin away from that script.
            # It starts in the private directory, where ./bash is its script.
            where.append(stdin_statement(stdin) if stdin is not None else "exec 0</dev/null")
            first = "\n".join(p if "\n" not in p else "builtin eval " + ansi_c_quote(p) for p in where)
            parts.append(ret_function(state.last_status, late, first))
            prelude = "\n".join(p if "\n" not in p else "builtin eval " + ansi_c_quote(p) for p in parts)
            arg = state.last_arg if state.last_arg is not None else "''"
            body = (
                f"__hermes_ret {arg}{' && :' if state.last_status else ''}; {command}\n"
                f"{capture_line()}; {epilogue(save_fn)}\n"
            )
            head = prelude.encode("utf-8", "surrogateescape")
            payload = f"{len(head)}\n".encode() + head + body.encode("utf-8", "surrogateescape")
            if channel == "inline":
                script = f"builtin : __hermes_n={nonce}; " + script_stub(
                    self.state_dir, login=login, inline=payload.decode("utf-8", "surrogateescape")
                )
                payload = b""
            else:
                script = script_stub(self.state_dir, login=login, from_file=private_path)
            return WrappedCommand(
                script, nonce, sep, slot, explicit, target_cwd, state_file, payload, private_path, pid_token
            )
        parts += where
        if stdin is not None:
            parts.append(stdin_statement(stdin))
        body = command
        if state is not None and not snapshot:
            parts.append(ret_function(state.last_status, late))
            arg = state.last_arg if state.last_arg is not None else "''"
            body = f"__hermes_ret {arg}{' && :' if state.last_status else ''}; {command}"
        if not command.endswith("\\"):
            body += "\n" + capture_line()
        parts.append("builtin eval " + ansi_c_quote(body))
        parts.append(epilogue(save_fn))
        text = one_line(parts)
        if channel == "inline":
            # The backend delivers this text privately itself (a heredoc of its own, say); the
            # marker lets a backend that follows the output find the frame's end.
            script, payload = f"builtin : __hermes_n={nonce}; " + text, b""
        else:
            script = stub(channel, private_path)
            payload = text.encode("utf-8", "surrogateescape")
        return WrappedCommand(
            script, nonce, sep, slot, explicit, target_cwd, state_file, payload, private_path, pid_token
        )

    def _take_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def release(self, wrapped: WrappedCommand) -> None:
        with self._lock:
            self._free_slots.append(wrapped.slot)

    def _restore(
        self, state: SessionState, baseline: SessionState | None, script_mode: bool = False
    ) -> tuple[list[str], str]:
        """(statements before the cd, what ``__hermes_ret`` applies last)."""
        b = baseline or SessionState()
        so_on = sorted((state.shellopts - b.shellopts) - _SKIP_SETO)
        so_off = sorted(((b.shellopts - state.shellopts) & state.all_seto) - _SKIP_SETO)
        bo_on = sorted((state.bashopts - b.bashopts) - _UNSETTABLE_SHOPT)
        bo_off = sorted(((b.bashopts - state.bashopts) & state.all_shopt) - _UNSETTABLE_SHOPT)
        out: list[str] = []
        if state.umask and (state.umask != b.umask or script_mode):
            out.append(f"builtin umask {state.umask}")
        # shopt before functions: extglob and friends change how they parse.
        if bo_on:
            out.append("builtin shopt -s " + " ".join(bo_on))
        if bo_off:
            out.append("builtin shopt -u " + " ".join(bo_off))
        out += [line for name, line in state.variables.items() if name != "OLDPWD" and b.variables.get(name) != line]
        removed = [n for n in b.variables if n not in state.variables and n != "OLDPWD"]
        if removed:
            out.append("builtin unset -v " + " ".join(removed) + " 2>/dev/null")
        defs = state.functions + ("\n" if state.functions and not state.functions.endswith("\n") else "")
        defs += state.aliases
        if defs.strip():
            out.append(defs if "\n" in defs.rstrip("\n") else defs + "\n")
        base_limits = {f: (s, h) for f, s, h in b.ulimits}
        for flag, soft, hard in state.ulimits:
            if flag == "p" or base_limits.get(flag) == (soft, hard):
                continue
            if base_limits.get(flag, ("", ""))[1] != hard:
                out.append(f"builtin ulimit -H -{flag} {hard} 2>/dev/null")
            out.append(f"builtin ulimit -S -{flag} {soft} 2>/dev/null")
        if state.hashes.strip() and state.hashes != b.hashes:
            out.append(state.hashes if "\n" in state.hashes.rstrip("\n") else state.hashes.rstrip("\n"))
        late_parts: list[str] = []
        for sig, stmt in state.traps:
            stmt = "builtin " + stmt
            (late_parts if sig in _LATE_TRAPS else out).append(stmt)
        # set -o last, xtrace at the very end: nothing of ours is traced.
        flags = [f"+o {o}" for o in so_off] + [f"-o {o}" for o in so_on if o != "xtrace"]
        if "xtrace" in so_on:
            flags.append("-o xtrace")
        if flags:
            late_parts.append("builtin set " + " ".join(flags))
        return out, one_line(late_parts) if late_parts else ""

    def restore_script(self, command: str, *, cwd: str | None = None, cd_fatal: bool = True) -> str:
        """``command`` preceded by the session's state and directory, with no
        state capture: for processes started outside ``execute()``. A
        directory that cannot be entered exits 126 naming it (``cd_fatal``;
        else the shell stays where it is and ``command`` runs there)."""
        check_command(command)
        with self._lock:
            state, baseline, session_cwd = self._state, self._baseline, self._cwd
        parts: list[str] = []
        late = ""
        if state is not None:
            parts, late = self._restore(state, baseline)
        target = _resolve_cwd(session_cwd, cwd)
        if target:
            parts.append(cd_line(target, None) if cd_fatal else f"builtin cd -- {quote_dir(target)} 2>/dev/null")
        if state is not None:
            parts += _after_cd(state)
        if late:
            parts.append(late)
        return (one_line(parts) + "\n" if parts else "") + command + "\n"

    def interactive_defaults(self, state: SessionState) -> SessionState:
        """The first state: aliases expanded, as in an interactive bash, and
        the configured directory (the snapshot itself ran where bash starts)."""
        return SessionState(
            **{
                **state.__dict__,
                "bashopts": state.bashopts | {"expand_aliases"},
                "cwd": self._default_cwd or state.cwd,
                "last_arg": None,
                "last_status": 0,
            }
        )

    # -- reading back ----------------------------------------------------
    def accept(self, wrapped: WrappedCommand, frame: Frame | None, *, as_baseline: bool = False) -> SessionState | None:
        """Install the state a finished command reported; None if it reported none."""
        if frame is None or frame.state_text is None:
            return None
        state = parse_state_dump(
            frame.state_text, wrapped.sep, self.excluded_prefixes, frame.cwd or None,
            names_from=self._baseline, status=frame.exit_code,
        )
        if state.exit_trap is not None and wrapped.nonce in state.exit_trap:
            # Our own EXIT trap, untouched by the command: the user's stays as it was.
            previous = self._state.exit_trap if self._state else None
            state = SessionState(**{**state.__dict__, "exit_trap": previous})
        if as_baseline:
            self.set_baseline(state)
            return state
        if wrapped.explicit_cwd:
            # A one-off cwd does not move the session.
            state = SessionState(**{**state.__dict__, "cwd": self._cwd})
        self.set_state(state)
        return state


def _after_cd(state: SessionState) -> list[str]:
    """What the ``cd`` into the session's directory changed back: OLDPWD and the directory stack."""
    old = state.variables.get("OLDPWD")
    # -g: in script mode this runs inside __hermes_ret.
    out = ["builtin declare -g" + old[len("declare"):] if old else "builtin unset -v OLDPWD"]
    if state.dirstack and "[1]=" in state.dirstack:
        out.append(
            f"__hermes_ds={state.dirstack}; "
            "for ((__hermes_i=${#__hermes_ds[@]}-1; __hermes_i>0; __hermes_i--)); do "
            'builtin pushd -n -- "${__hermes_ds[__hermes_i]}" >/dev/null 2>&1; done; '
            "builtin unset -v __hermes_ds __hermes_i"
        )
    return out


def _resolve_cwd(session_cwd: str | None, cwd: str | None) -> str | None:
    """``cwd`` (a relative one against the session's), else the session's own."""
    if cwd is None:
        return session_cwd
    if session_cwd and not posixpath.isabs(cwd) and not cwd.startswith("~"):
        return posixpath.join(session_cwd, cwd)
    return cwd


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
