"""``hermes-env shell``: an interactive prompt over one session.

Line editing and history come from readline (history kept in
``$HERMES_ENV_HISTFILE``, else ``$XDG_STATE_HOME/hermes-env/shell_history``);
an unfinished command continues on the next line, judged by ``bash -n`` as
bash's PS2 would; Tab completes with ``compgen`` run in the session itself.
Lines that want a terminal run on one (``cli.tty``): ``--tty`` and ``:tty`` say which.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..environment.base import BaseEnvironment
from ..errors import HermesEnvError, UsageError
from . import tty
from .common import PROG, environment, execute, print_notes

__all__ = ["add_arguments", "cmd_shell", "complete_candidates", "history_path", "is_incomplete"]

HISTFILE_ENV_VAR = "HERMES_ENV_HISTFILE"
HISTORY_LINES = 5000
COMPLETION_TIMEOUT = 10.0
_EXIT_RE = re.compile(r"^\s*exit(?:\s+(\d+))?\s*;?\s*$")
_READ_RE = re.compile(r"(^|[;&|({]\s*|\bthen\s+|\bdo\s+)read\b")
_TTY_RE = re.compile(r"^\s*:tty(?:\s+(.*))?$", re.DOTALL)
# What ends a word for completion: the rest (/, $, -, ., =, ~) stays part of the word.
_DELIMS = " \t\n;|&<>()"


def history_path(environ: dict[str, str] | None = None) -> Path | None:
    """Where the shell keeps its history; None when ``$HERMES_ENV_HISTFILE`` is set empty."""
    env = os.environ if environ is None else environ
    if HISTFILE_ENV_VAR in env:
        return Path(env[HISTFILE_ENV_VAR]).expanduser() if env[HISTFILE_ENV_VAR] else None
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "hermes-env" / "shell_history"


def is_incomplete(text: str) -> bool:
    """Whether bash would ask for more (PS2) after ``text``: open quote, loop, if, heredoc, trailing ``\\``."""
    stripped = text.rstrip("\n")
    trailing = len(stripped) - len(stripped.rstrip("\\"))
    if trailing % 2 == 1:
        return True
    try:
        proc = subprocess.run(
            ["bash", "-n"],
            input=text + "\n",
            capture_output=True,
            text=True,
            timeout=10,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return False  # no local bash to ask: run the line, and the target's bash says what is wrong
    err = proc.stderr
    return (
        "unexpected end of file" in err
        or "unexpected EOF while looking for matching" in err
        or ("here-document" in err and "delimited by end-of-file" in err)
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shell's own options."""
    parser.add_argument(
        "--tty",
        choices=tty.TTY_MODES,
        default="auto",
        help="which lines run on a terminal: auto (programs that want one: python3, top, vim, less, ssh, "
        "stty...), on (every line but the shell's own builtins, which must keep their effect), off; "
        "change it with `:tty MODE`, run one line on a terminal with `:tty COMMAND`",
    )


def cmd_shell(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    with environment(args, no_default_timeout=True) as env:
        if args.cwd:
            result = env.execute(f"cd -- {shlex.quote(args.cwd)}")
            if result.exit_code != 0:
                raise UsageError(f"shell: {result.output.strip() or 'cannot enter ' + args.cwd}")
        with _line_editing(env, interactive) as state, _prompt_interrupts(interactive) as nudge:
            state.tty_mode = getattr(args, "tty", None) or "auto"
            state.nudge = nudge
            return _loop(env, interactive, state)


class _Nudge:
    """Python's readline runs a signal's handler only when its select() is interrupted, so a Ctrl-C that
    lands between the prompt being drawn and that select() waits for the next key (one in eight, typed
    right after the prompt). A thread sees each signal arrive (``signal.set_wakeup_fd``) and, while the
    Ctrl-C is still pending at the prompt, interrupts the main thread again with SIGWINCH."""

    _EVERY_S = 0.05
    _TRIES = 40

    def __init__(self) -> None:
        self.at_prompt = False
        self.pending = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._forwarding = threading.Lock()
        self._previous = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._main = threading.main_thread().ident
        threading.Thread(target=self._watch, name="hermes-env-prompt-sigint", daemon=True).start()

    def _watch(self) -> None:
        try:
            self._watch_until_closed()
        finally:
            os.close(self._r)  # here, not in close(): a number closed under a read could be reused

    def _watch_until_closed(self) -> None:
        while True:
            data = os.read(self._r, 64)
            if not data:
                return  # close() closed the write end
            with self._forwarding:
                if self._previous >= 0:
                    # Python has one wakeup fd: the one this replaced (the CLI's signal guard's
                    # watcher, which re-sends a SIGTERM or SIGHUP that readline missed) still sees them.
                    with contextlib.suppress(OSError):
                        os.write(self._previous, data)
            if signal.SIGINT not in data:
                continue
            self.pending = True
            for _ in range(self._TRIES):
                time.sleep(self._EVERY_S)
                if not self.pending:
                    break
                if self.at_prompt and self._main is not None:
                    with contextlib.suppress(OSError, ValueError):
                        signal.pthread_kill(self._main, signal.SIGWINCH)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous)
        with self._forwarding:
            self._previous = -1  # its owner may close it from now on
        os.close(self._w)  # the watcher reads end of file, and closes its end


@contextlib.contextmanager
def _prompt_interrupts(interactive: bool) -> Iterator[_Nudge | None]:
    if not interactive or threading.current_thread() is not threading.main_thread():
        yield None
        return
    # SIGWINCH must interrupt a system call: readline's handler does; keep any there is.
    if signal.getsignal(signal.SIGWINCH) in (signal.SIG_DFL, signal.SIG_IGN):
        signal.signal(signal.SIGWINCH, lambda signum, frame: None)
    nudge = _Nudge()
    try:
        yield nudge
    finally:
        nudge.close()


class _State:
    def __init__(self) -> None:
        self.last = 0
        self.tty_mode = "auto"
        self.nudge: _Nudge | None = None

    def prompt(self, on: bool) -> None:
        """At the prompt (or leaving it): a Ctrl-C seen before this counts as dealt with."""
        if self.nudge is not None:
            self.nudge.pending = False
            self.nudge.at_prompt = on


def _loop(env: BaseEnvironment, interactive: bool, state: _State) -> int:
    while True:
        status = f" [{state.last}]" if state.last else ""
        prompt = f"({env.name}) {env.session.cwd or ''}{status}$ " if interactive else ""
        state.prompt(True)
        try:
            command = _read_command(prompt, interactive)
        except EOFError:
            if interactive:
                print()
            return state.last
        except KeyboardInterrupt:
            print()  # Ctrl-C at the prompt discards the line, as in bash
            continue
        finally:
            state.prompt(False)
        if not command.strip():
            continue
        match = _EXIT_RE.match(command)
        if match:
            return int(match.group(1)) if match.group(1) else state.last
        try:
            _run_line(env, command, interactive, state)
        except KeyboardInterrupt:
            # Ctrl-C between reading the line and its command starting (or after it ended): the line is
            # cancelled, the shell stays.
            print()
            state.last = 130


def _run_line(env: BaseEnvironment, command: str, interactive: bool, state: _State) -> None:
    forced = _TTY_RE.match(command)
    if forced:
        rest = (forced.group(1) or "").strip()
        if rest in tty.TTY_MODES or not rest:
            state.tty_mode = rest or state.tty_mode
            if interactive:
                print(f"tty: {state.tty_mode}")
            else:
                print(f"{PROG}: tty: {state.tty_mode} (no terminal here: lines run without one)", file=sys.stderr)
            return
        command = rest
    if interactive and (forced or _on_terminal(env, command, state.tty_mode)):
        tty.print_state_warning(command)
        state.last = tty.run_tty(env, command, newline_after=True)
        # The session's $? follows, as after any other line.
        execute(env, f"( exit {state.last} )", out=io.StringIO())
        return
    result = execute(env, command, out=sys.stdout, newline_after=interactive)
    print_notes(result)
    state.last = result.exit_code
    if interactive and result.exit_code != 0 and _READ_RE.search(command):
        print(
            f"{PROG}: `read` saw end of input: this line ran without a terminal; "
            "run it on one with `:tty COMMAND`, or give it input in the command (read x <<< 'text')",
            file=sys.stderr,
        )


def _on_terminal(env: BaseEnvironment, command: str, mode: str) -> bool:
    functions: frozenset[str] = frozenset()
    if mode == "on":
        state = env.session.state
        functions = frozenset(state.function_names) if state is not None else frozenset()
    return tty.needs_terminal(command, mode, functions=functions)


def _read_command(prompt: str, interactive: bool) -> str:
    lines: list[str] = []
    while True:
        if interactive:
            try:
                line = input(prompt if not lines else "> ")
            except EOFError:
                if lines:  # bash: the unfinished command runs, and says what is missing
                    print()
                    break
                raise
        else:
            raw = sys.stdin.readline()
            if not raw:
                if lines:
                    break
                raise EOFError
            line = raw.rstrip("\n")
        lines.append(line)
        if not is_incomplete("\n".join(lines)):
            break
    return "\n".join(lines)


# -- readline: history and completion ------------------------------------------------------


@contextlib.contextmanager
def _line_editing(env: BaseEnvironment, interactive: bool) -> Iterator[_State]:
    state = _State()
    readline: Any = None
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # line editing and history for input()
    if readline is None:
        yield state
        return
    path = history_path(dict(os.environ))
    start = _load_history(readline, path)
    readline.set_completer_delims(_DELIMS)
    readline.set_completer(_completer(readline, env, state))
    readline.parse_and_bind("tab: complete")
    try:
        yield state
    finally:
        readline.set_completer(None)
        _save_history(readline, path, start)


def _load_history(readline: Any, path: Path | None) -> int:
    if path is None:
        return int(readline.get_current_history_length())
    with contextlib.suppress(FileNotFoundError, OSError):
        readline.read_history_file(str(path))
    return int(readline.get_current_history_length())


def _save_history(readline: Any, path: Path | None, start: int) -> None:
    if path is None:
        return
    new = readline.get_current_history_length() - start
    if new <= 0:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(fd)
        # Appending keeps what another session wrote meanwhile.
        readline.append_history_file(new, str(path))
        readline.set_history_length(HISTORY_LINES)
        with open(path, encoding="utf-8", errors="replace") as fh:
            count = sum(1 for _ in fh)
        if count > HISTORY_LINES * 2:
            readline.clear_history()
            readline.read_history_file(str(path))
            readline.write_history_file(str(path))
    except OSError as exc:
        print(f"{PROG}: warning: history not saved to {path}: {exc}", file=sys.stderr)


def _completer(readline: Any, env: BaseEnvironment, state: _State) -> Callable[[str, int], str | None]:
    matches: list[str] = []

    def complete(text: str, index: int) -> str | None:
        if index == 0:
            line = readline.get_line_buffer()
            before = line[: readline.get_begidx()]
            matches[:] = complete_candidates(env, text, before, last_status=state.last)
        return matches[index] if index < len(matches) else None

    return complete


def complete_candidates(env: BaseEnvironment, text: str, before: str, *, last_status: int = 0) -> list[str]:
    """What Tab offers for ``text`` after ``before`` on the line, asked of the session's own bash.

    A word after ``$`` completes variable names; the first word of a command
    completes commands, functions, aliases and builtins; any other word, or a
    word with a ``/``, completes paths (directories with a trailing ``/``).
    The completion runs in a subshell and leaves ``$?`` as it was, so the
    session does not notice it.
    """
    word = shlex.quote(text)
    if text.startswith("$"):
        body, prefix = f"compgen -v -- {shlex.quote(text[1:])}", "$"
    elif _command_position(before) and "/" not in text:
        body, prefix = f"compgen -abck -A function -- {word}", ""
    else:
        body = (
            f"compgen -f -- {word} | while IFS= read -r f; do "
            'if [ -d "$f" ]; then printf "%s/\\n" "$f"; else printf "%s\\n" "$f"; fi; done'
        )
        prefix = ""
    script = f"( {body} ) 2>/dev/null | LC_ALL=C sort -u | head -n 500; ( exit {int(last_status)} )"
    try:
        result = env.execute(script, timeout=COMPLETION_TIMEOUT)
    except HermesEnvError:
        return []
    if result.timed_out or result.interrupted:
        return []
    return [prefix + line for line in result.output.splitlines() if line]


def _command_position(before: str) -> bool:
    stripped = before.rstrip()
    if not stripped:
        return True
    return stripped.endswith((";", "|", "&", "(", "{", "!")) or stripped.split()[-1] in (
        "then",
        "do",
        "else",
        "elif",
        "if",
        "while",
        "until",
        "time",
        "sudo",
        "exec",
        "command",
    )
