"""The ``hermes-env`` command: run a command or an interactive shell on any backend, and inspect the setup.

Exit status: ``run`` passes the command's own status through; usage and
configuration errors exit 2; failures of hermes-env itself (backend
unreachable, environment lost, plugin broken) exit 125, as ``docker run``,
``timeout`` and ``env`` do.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import platform
import shlex
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from .. import mcp as mcp_cli
from ..config import ConfigWarning
from ..environment.result import ExecResult
from ..errors import HermesEnvError, UsageError
from ..plugins.manager import CORE_DISTRIBUTION, PluginLoadWarning
from ..processes import cli as background_cli
from ..sync import cli as sync_cli
from . import info, sessions, shell, snapshots, tty
from .signals import SignalExit, SignalGuard
from .common import (
    command_options,
    EXIT_FAILURE,
    EXIT_USAGE,
    PROG,
    SyncProgressBar,
    add_command,
    environment,
    environment_options,
    execute,
    exit_status_of,
    print_notes,
)

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "SyncProgressBar", "build_parser", "exit_status_of", "format_stats", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    # mcp serves over asyncio and handles these signals itself (mcp.serve).
    guard = None if args.func is mcp_cli.main else SignalGuard(keyboard_interrupt=_keyboard_interrupts(args))
    quiet = getattr(args, "lists_plugins", False)
    # `config` lists ignored settings itself, with the reason.
    with _one_line_warnings(quiet=quiet, quiet_config=args.func is info.cmd_config), guard or contextlib.nullcontext():
        try:
            status = int(args.func(args))
        except SignalExit as exc:
            return _stopped(exc.signum)
        except HermesEnvError as exc:
            if guard is not None and guard.received is not None:
                return _stopped(guard.received)
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return exit_status_of(exc)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        except BrokenPipeError:
            # stdout went away (| head); exit quietly like other Unix tools
            with contextlib.suppress(Exception):
                sys.stdout = open("/dev/null", "w")  # noqa: SIM115
            return 141
        except Exception:
            # A bug of ours: keep the traceback, but never an exit status a command could have.
            traceback.print_exc()
            print(f"{PROG}: internal error (exit status {EXIT_FAILURE})", file=sys.stderr)
            return EXIT_FAILURE
        if guard is not None and guard.received is not None:
            return _stopped(guard.received)
        return status


def _keyboard_interrupts(args: argparse.Namespace) -> bool:
    """In an interactive shell, Ctrl-C cancels the command and keeps the prompt, as in bash."""
    return args.func is shell.cmd_shell and sys.stdin.isatty()


def _stopped(signum: int) -> int:
    """The status ``docker run`` gives when a signal stopped it: 128 + the signal's number."""
    print(f"{PROG}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + signum


def version_text() -> str:
    try:
        version = importlib.metadata.version(CORE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    return f"{PROG} {version} ({CORE_DISTRIBUTION}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run shell commands on local, docker, ssh or plugin backends, as in one long-lived bash.",
        epilog="Exit status: a command's own status; 2 for usage and configuration errors; "
        "125 when hermes-env itself fails (backend unreachable, environment lost).",
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    env_opts = environment_options()
    cmd_opts = command_options()

    p = add_command(
        sub,
        "run",
        "run one command; its exit status is ours",
        "Run COMMAND in the chosen backend as one long-lived bash would, stream its output (stdout and stderr "
        "merged, in order) and exit with its status: 124 on timeout, 126 if the cwd cannot be entered, "
        "130 if cancelled with Ctrl-C. With --background it starts detached and prints its id.",
        parents=[env_opts, cmd_opts],
    )
    p.add_argument("--stdin", action="store_true", help="pass this process's standard input to the command")
    p.add_argument("--stats", action="store_true", help="after the output, print what the command cost (on stderr)")
    p.add_argument("--tty", action="store_true", help="run it on a terminal, keys and window size passed on (REPLs, top)")
    background_cli.add_run_arguments(p)
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="one word: a shell command line ('ls | wc -l'); several words: one program and its arguments, "
        "passed as they are (python3 -c 'print(1)')",
    )
    p.set_defaults(func=_cmd_run)
    background_cli.add_subcommands(sub, parents=[env_opts], environment=environment)
    sync_cli.add_subcommands(sub, parents=[env_opts], environment=environment)

    p = add_command(
        sub,
        "shell",
        "an interactive prompt over one session",
        "An interactive prompt whose commands share one session: variables, functions, aliases, options and "
        "the working directory carry over. History is kept across sessions; an unfinished line (a loop, a "
        "quote, a heredoc) continues on the next; Tab completes from the target. No timeout unless --timeout.",
        parents=[env_opts, cmd_opts],
    )
    shell.add_arguments(p)
    p.set_defaults(func=shell.cmd_shell)

    info.add_commands(sub, env_opts)
    snapshots.add_commands(sub)
    sessions.add_commands(sub)
    mcp_cli.add_parser(sub)
    return parser


# -- run ----------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    words = list(args.command)
    if words and words[0] == "--":
        words = words[1:]
    # One word is a shell command line; several are one argv, quoted as docker exec takes them.
    command = words[0] if len(words) == 1 else shlex.join(words)
    if not command.strip():
        raise UsageError("run: no command given")
    if getattr(args, "tty", False):
        return tty.cmd_run(args, command)
    if getattr(args, "background", False):
        with environment(args, background=True) as env:
            return background_cli.run_background(args, env, command)
    stdin = sys.stdin.buffer.read() if args.stdin else None
    with environment(args) as env:
        result = execute(env, command, cwd=args.cwd, stdin=stdin, out=sys.stdout)
    print_notes(result)
    if args.stats:
        print(format_stats(result), file=sys.stderr)
    return result.exit_code


def format_stats(result: ExecResult) -> str:
    """One line: why it ended, how long, CPU and peak memory (``?`` where the target cannot tell)."""
    u = result.usage

    def secs(v: float | None) -> str:
        return "?" if v is None else f"{v:.3f}s"

    ended = str(result.end_reason) + (f" (signal {result.signal})" if result.signal else "")
    rss = "?" if u.max_rss_bytes is None else f"{u.max_rss_bytes / 1048576:.1f} MiB"
    oom = "" if u.oom_killed is None else f"  oom_killed {str(u.oom_killed).lower()}"
    return (
        f"[stats] {ended}, exit {result.exit_code}, wall {result.duration_s:.3f}s, "
        f"cpu user {secs(u.cpu_user_s)} sys {secs(u.cpu_system_s)}, max rss {rss}{oom}"
    )


@contextlib.contextmanager
def _one_line_warnings(*, quiet: bool, quiet_config: bool = False) -> Iterator[None]:
    """Plugin and configuration warnings as one line each (or not at all where the command lists them anyway)."""
    original = warnings.showwarning
    seen: set[str] = set()

    def show(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, *rest: Any, **kw: Any
    ) -> None:
        if issubclass(category, PluginLoadWarning):
            if not quiet:
                print(f"{PROG}: warning: {message}", file=sys.stderr)
            return
        if issubclass(category, ConfigWarning):
            if not quiet_config and str(message) not in seen:
                seen.add(str(message))
                print(f"{PROG}: warning: {message}", file=sys.stderr)
            return
        original(message, category, filename, lineno, *rest, **kw)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original
