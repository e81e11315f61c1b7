"""Which lines of ``hermes-env shell`` run on a terminal: a bash tokenizer good enough to find command words.

``needs_terminal(line, mode)`` is the rule; ``simple_commands`` and ``state_changes`` are what it reads.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

__all__ = [
    "BASH_BUILTINS",
    "INTERACTIVE_PROGRAMS",
    "STATE_BUILTINS",
    "TTY_MODES",
    "SimpleCommand",
    "needs_terminal",
    "simple_commands",
    "state_changes",
]

#: How the shell picks the lines that run on a terminal (``--tty`` / ``:tty``).
TTY_MODES = ("auto", "on", "off")

#: Programs that want a terminal: REPLs, shells, full-screen and paging programs, terminal tools.
INTERACTIVE_PROGRAMS = frozenset(
    """
    python python2 python3 ipython ipython3 bpython ptpython pypy pypy3 node nodejs deno bun irb pry ghci
    lua luajit R julia scala sbt clj clojure erl iex guile racket sbcl ocaml utop swipl jshell gdb lldb
    sqlite3 psql mysql mariadb mongo mongosh redis-cli cqlsh duckdb clickhouse-client
    bash sh dash zsh fish ksh mksh tcsh csh ash
    top htop btop atop iotop iftop nload glances watch nvtop
    less more most man info pager
    vi vim nvim view vimdiff ex nano pico emacs micro joe mcedit
    mc ranger nnn lf tig lazygit ncdu fzf dialog whiptail tmux screen w3m lynx links elinks mutt neomutt
    ssh telnet ftp sftp mosh passwd su login visudo vipw
    stty tput tty clear reset tset setterm
    """.split()
)
_VERSIONED = re.compile(r"^(python|pypy|ipython)[0-9]+(\.[0-9]+)*$")
# Container tools whose run/exec want our terminal when asked for one (-t, -it, --tty).
_CONTAINER_TOOLS = {"docker": {"run", "exec", "attach"}, "podman": {"run", "exec", "attach"},
                    "nerdctl": {"run", "exec", "attach"}, "kubectl": {"run", "exec", "attach"}}

_KEYWORDS_BEFORE_COMMAND = {"if", "then", "else", "elif", "do", "while", "until", "!", "{", "}", "fi", "done",
                            "esac", "time", "coproc", "[[", "]]"}
_KEYWORDS_WITH_ARGS = {"for", "select", "case", "function", "in"}
BASH_BUILTINS = frozenset(
    """
    . : [ alias bg bind break builtin caller cd command compgen complete compopt continue declare dirs disown
    echo enable eval exec exit export false fc fg getopts hash help history jobs kill let local logout mapfile
    popd printf pushd pwd read readarray readonly return set shift shopt source suspend test times trap true
    type typeset ulimit umask unalias unset wait
    """.split()
)
#: Builtins whose effect is on the shell itself: on a terminal line it does not carry over.
STATE_BUILTINS = frozenset(
    "cd pushd popd export unset declare typeset local readonly alias unalias source . set shopt umask ulimit "
    "trap hash enable".split()
)
# Wrappers that run the next word as the command; the options that take an argument.
_WRAPPERS: dict[str, set[str]] = {
    "sudo": {"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U", "-T"},
    "doas": {"-u", "-C"},
    "env": {"-u", "-C", "-S", "--unset", "--chdir"},
    "exec": {"-a"},
    "command": set(),
    "builtin": set(),
    "nice": {"-n"},
    "nohup": set(),
    "stdbuf": {"-i", "-o", "-e"},
    "ionice": {"-c", "-n", "-p"},
    "timeout": {"-s", "-k", "--signal", "--kill-after"},
    "time": {"-f", "-o"},
}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=")
_OPERATORS = ("&&", "||", ";;&", ";;", ";&", "|&", "$(", "&", "|", ";", "(", ")", "\n", "`")
_REDIRECTS = ("&>>", "<<<", "<<-", "&>", ">>", ">&", "<&", ">|", "<>", "<<", ">", "<")


@dataclass(frozen=True)
class SimpleCommand:
    """One simple command of a line: its command word (unquoted, after assignments and wrappers) and arguments.

    ``program`` is "" for a command that is only assignments.
    """

    program: str
    args: tuple[str, ...] = ()
    assignments: int = 0


def _tokens(line: str) -> list[tuple[str, str]]:
    """(kind, text) pairs of a bash line: ``word`` (quotes removed), ``op`` and ``redir``; heredoc bodies left out."""
    out: list[tuple[str, str]] = []
    word: list[str] = []
    in_word = False
    delims: list[str] = []  # heredoc delimiters whose bodies start at the next newline
    want_delim = False
    i, n = 0, len(line)

    def end_word() -> None:
        nonlocal in_word, want_delim
        if in_word:
            text = "".join(word)
            if want_delim:
                delims.append(text)
                want_delim = False
            else:
                out.append(("word", text))
        word.clear()
        in_word = False

    while i < n:
        c = line[i]
        if c in " \t":
            end_word()
            i += 1
            continue
        if c == "#" and not in_word:
            while i < n and line[i] != "\n":
                i += 1
            continue
        if c == "\\":
            if i + 1 < n and line[i + 1] == "\n":
                i += 2
                continue
            word.append(line[i + 1 : i + 2])
            in_word = True
            i += 2
            continue
        if c == "'" or (c == "$" and line.startswith("$'", i)):
            j = i + (2 if c == "$" else 1)
            k = line.find("'", j)
            while c == "$" and k > 0 and line[k - 1] == "\\":
                k = line.find("'", k + 1)
            k = n if k < 0 else k
            word.append(line[j:k])
            in_word = True
            i = k + 1
            continue
        if c == '"':
            j = i + 1
            while j < n and line[j] != '"':
                if line[j] == "\\" and j + 1 < n:
                    j += 1
                word.append(line[j])
                j += 1
            in_word = True
            i = j + 1
            continue
        op = next((o for o in _OPERATORS if line.startswith(o, i)), None)
        if op == "$(" and line.startswith("$((", i):
            op = None  # arithmetic, not a command
        if op is not None:
            end_word()
            out.append(("op", op))
            i += len(op)
            if op == "\n" and delims:
                i = _past_heredocs(line, i, delims)
                delims.clear()
            continue
        redir = next((r for r in _REDIRECTS if line.startswith(r, i)), None)
        if redir is not None:
            if in_word and "".join(word).isdigit():
                word.clear()  # a descriptor number (2>), not a word
                in_word = False
            end_word()
            if redir in ("<<", "<<-"):
                want_delim = True
            else:
                out.append(("redir", redir))
            i += len(redir)
            continue
        word.append(c)
        in_word = True
        i += 1
    end_word()
    return out


def _past_heredocs(line: str, i: int, delims: list[str]) -> int:
    """Where the text goes on after the heredoc bodies starting at ``i`` (each ends at its delimiter line)."""
    for delim in delims:
        while i < len(line):
            end = line.find("\n", i)
            end = len(line) if end < 0 else end
            body_line = line[i:end]
            i = end + 1
            if body_line.lstrip("\t") == delim:
                break
    return min(i, len(line))


def simple_commands(line: str) -> list[SimpleCommand]:
    """The simple commands of a bash line, in order, as far as a tokenizer without a grammar can tell.

    Quotes and backslashes are removed from words; ``VAR=value`` prefixes and
    wrappers (``sudo``, ``env``, ``exec``, ``nice``, ``time``, ...) are looked
    through; loop lists (``for x in ...``), heredoc bodies and redirection
    targets are not commands. Never raises: an unfinished quote ends the line.
    """
    cmds: list[SimpleCommand] = []
    state = "cmd"  # cmd: expecting a command word; args: inside one; skip: keyword arguments
    wrapper: str | None = None
    program = ""
    args: list[str] = []
    assignments = 0
    skip_word = False
    tokens = _tokens(line)
    idx = 0

    def flush() -> None:
        nonlocal program, args, assignments
        if program or assignments:
            cmds.append(SimpleCommand(program, tuple(args), assignments))
        program, args, assignments = "", [], 0

    while idx < len(tokens):
        kind, text = tokens[idx]
        idx += 1
        if kind == "redir":
            skip_word = True
            continue
        if kind == "op":
            flush()
            wrapper = None
            state = "cmd"
            continue
        if skip_word:
            skip_word = False
            continue
        if state == "skip":
            if text == "{":
                state = "cmd"
            continue
        if state == "args":
            args.append(text)
            continue
        if state == "wrap":
            assert wrapper is not None
            if text.startswith("-") and text != "-":
                if text in _WRAPPERS[wrapper]:
                    skip_word = True
                continue
            if wrapper == "env" and _ASSIGNMENT.match(text):
                continue
            if wrapper == "timeout" and re.match(r"^[0-9.]+[smhd]?$", text):
                wrapper = None
                state = "cmd"
                continue
            state = "cmd"
            wrapper = None
        # state == "cmd"
        if _ASSIGNMENT.match(text) and not program:
            assignments += 1
            continue
        if text in _KEYWORDS_BEFORE_COMMAND:
            continue
        if text in _KEYWORDS_WITH_ARGS:
            state = "skip"
            continue
        if text in _WRAPPERS:
            wrapper, state = text, "wrap"
            continue
        program, state = text, "args"
    flush()
    return cmds


def _wants_terminal(cmd: SimpleCommand) -> bool:
    name = posixpath.basename(cmd.program)
    if name in INTERACTIVE_PROGRAMS or _VERSIONED.match(name):
        return True
    subcommands = _CONTAINER_TOOLS.get(name)
    if subcommands and cmd.args and cmd.args[0] in subcommands:
        for a in cmd.args[1:]:
            if a == "--tty" or (a.startswith("-") and not a.startswith("--") and "t" in a[1:]):
                return True
    return False


def needs_terminal(line: str, mode: str = "auto", *, functions: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether the shell runs ``line`` on a terminal.

    ``auto``: when one of its commands is a program that wants a terminal
    (``INTERACTIVE_PROGRAMS``, ``docker exec -it`` and kin). ``on``: unless its
    first command is the shell's own (a builtin, a keyword, one of the
    session's ``functions``, or only assignments), which must run in the
    session to keep its effect. ``off``: never.
    """
    if mode not in TTY_MODES:
        raise ValueError(f"tty mode must be one of {', '.join(TTY_MODES)}, not {mode!r}")
    if mode == "off":
        return False
    cmds = simple_commands(line)
    if mode == "auto":
        return any(_wants_terminal(c) for c in cmds)
    if not cmds:
        return False
    first = cmds[0].program
    return bool(first) and first not in BASH_BUILTINS and first not in functions


def state_changes(line: str) -> list[str]:
    """The builtins (and assignments) of ``line`` that change the shell itself, in order."""
    out: list[str] = []
    for c in simple_commands(line):
        if c.program in STATE_BUILTINS:
            out.append(c.program)
        elif not c.program and c.assignments:
            out.append("assignment")
    return out
