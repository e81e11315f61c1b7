"""What the hermes-env subcommands share: opening the environment, running a command, exit statuses."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

from ..environment.base import BaseEnvironment
from ..environment.result import ExecResult
from ..errors import BackendNotFoundError, ConfigError, HermesEnvError, UsageError
from ..factory import EnvironmentFactory
from .signals import current_guard

__all__ = [
    "add_command",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "PROG",
    "SyncProgressBar",
    "environment",
    "command_options",
    "environment_options",
    "execute",
    "exit_status_of",
    "factory_for",
    "print_notes",
    "print_table",
]

PROG = "hermes-env"
EXIT_USAGE = 2
EXIT_FAILURE = 125


def exit_status_of(exc: HermesEnvError) -> int:
    """2 for what the user can fix in the invocation or the configuration; 125 for everything else."""
    return EXIT_USAGE if isinstance(exc, (ConfigError, BackendNotFoundError, UsageError)) else EXIT_FAILURE


def add_command(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    name: str,
    summary: str,
    description: str,
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """A subcommand with a one-line summary (in the command list) and a description (in its --help)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=description, **kwargs)
    return parser


def command_options() -> argparse.ArgumentParser:
    """``--cwd`` and ``--timeout``, for subcommands that run commands."""
    cmd_opts = argparse.ArgumentParser(add_help=False)
    cmd_opts.add_argument("--cwd", metavar="DIR", help="working directory in the target")
    cmd_opts.add_argument("--timeout", metavar="SECONDS", type=_positive_float, help="per-command timeout")
    return cmd_opts


def environment_options() -> argparse.ArgumentParser:
    """``--env``, ``-o`` and ``--config-file``, shared by every subcommand that opens or describes an environment."""
    env_opts = argparse.ArgumentParser(add_help=False)
    env_opts.add_argument("--env", metavar="NAME", help="backend (default: $TERMINAL_ENV, the config file, else local)")
    env_opts.add_argument(
        "-o",
        "--option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        type=_key_value,
        help="a backend option, highest precedence (repeatable; JSON for lists and dicts)",
    )
    env_opts.add_argument(
        "--config-file", metavar="PATH", help="config file (default: $HERMES_ENV_CONFIG, ./hermes-env.toml)"
    )
    add_session_options(env_opts)
    return env_opts


def add_session_options(parser: argparse.ArgumentParser) -> None:
    """``--session NAME`` and its companions (see ``hermes-env sessions``)."""
    g = parser.add_argument_group("named sessions")
    g.add_argument(
        "--session", metavar="NAME",
        help="attach to the named session NAME (created on first use): its shell state, background jobs and files "
        "carry over between invocations until 'hermes-env sessions rm NAME'",
    )
    g.add_argument(
        "--no-wait", dest="session_wait", action="store_false", default=True,
        help="(--session) fail at once while another process's command runs in the session, instead of waiting",
    )
    g.add_argument(
        "--restore", dest="session_restore", action="store_true",
        help="(--session) if the session's target was lost, restore its last checkpoint into a new one",
    )
    g.add_argument(
        "--session-idle-timeout", metavar="SECONDS", type=_positive_float,
        help="(--session) end the session after this long with nobody attached (default: never)",
    )


def execute(
    env: BaseEnvironment,
    command: str,
    *,
    out: TextIO,
    cwd: str | None = None,
    stdin: bytes | None = None,
    newline_after: bool = False,
) -> ExecResult:
    """Run one command, streaming its output; Ctrl-C cancels the command, not us."""
    cancel = threading.Event()
    last = ["\n"]

    def on_output(text: str) -> None:
        out.write(text)
        out.flush()
        last[0] = text[-1]

    def on_sigint(signum: int, frame: Any) -> None:
        cancel.set()

    guard = current_guard()
    if guard is not None:
        # SIGTERM, SIGHUP, SIGINT: execute() stops the command's tree; then we stop too (see signals).
        with guard.running(cancel):
            result = env.execute(command, cwd=cwd, stdin=stdin, cancel=cancel, on_output=on_output)
        guard.check()
    else:
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, on_sigint) if in_main else None
        try:
            result = env.execute(command, cwd=cwd, stdin=stdin, cancel=cancel, on_output=on_output)
        finally:
            if in_main:
                signal.signal(signal.SIGINT, previous)
    if newline_after and last[0] != "\n":
        out.write("\n")
        out.flush()
    return result


def print_notes(result: ExecResult) -> None:
    for note in result.notes:
        print(f"{PROG}: {note}", file=sys.stderr)
    if result.interrupted and not result.notes:
        print(f"{PROG}: command cancelled", file=sys.stderr)


def factory_for(args: argparse.Namespace) -> EnvironmentFactory:
    return EnvironmentFactory(config_file=getattr(args, "config_file", None))


@contextlib.contextmanager
def environment(
    args: argparse.Namespace, *, background: bool = False, no_default_timeout: bool = False
) -> Iterator[BaseEnvironment]:
    """Open the environment ``args`` name (``--env``, ``-o``, ``--timeout``); closed on the way out.

    ``background``: the environment must outlive this process (a detached
    command runs in it), so backends that can keep their target are asked to
    (``persistent``), under a task id recorded with the process.
    ``no_default_timeout``: the per-command timeout is None unless the user set one anywhere.
    """
    factory = factory_for(args)
    options: dict[str, Any] = {}
    if getattr(args, "timeout", None) is not None:
        options["timeout"] = args.timeout
    strings = dict(args.option)
    if getattr(args, "session", None) is not None:
        with _named_environment(args, factory, strings, options, background=background) as env:
            yield env
        return
    resolved = factory.resolve(args.env, option_strings=strings, **options)
    if no_default_timeout and resolved.values["timeout"].source == "default":
        options["timeout"] = None
        resolved = factory.resolve(args.env, option_strings=strings, **options)
    if background:
        from ..processes import cli as background_cli

        resolved = background_cli.keep_alive(factory, resolved, args.env, strings, options)
    guard = current_guard()
    # A signal while the environment is made or closed waits, so that nothing is left half made.
    with guard.deferred() if guard is not None else contextlib.nullcontext():
        env = factory.create_resolved(resolved)
    if hasattr(env, "sync_progress") and sys.stderr.isatty():
        env.sync_progress = SyncProgressBar(sys.stderr)
    try:
        if guard is not None:
            guard.check()
        yield env
    except BaseException:
        # The error raised first is the exit status; one from close (a failed pull-back) is still said.
        try:
            with guard.deferred() if guard is not None else contextlib.nullcontext():
                env.close()
        except HermesEnvError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise
    with guard.deferred() if guard is not None else contextlib.nullcontext():
        env.close()


@contextlib.contextmanager
def _named_environment(
    args: argparse.Namespace,
    factory: EnvironmentFactory,
    strings: dict[str, str],
    options: dict[str, Any],
    *,
    background: bool,
) -> Iterator[BaseEnvironment]:
    """The named session ``--session`` names, attached (or created), and detached on the way out."""
    if background:
        raise UsageError("--session and --background cannot be used together (a named session already outlives this call)")
    guard = current_guard()
    with guard.deferred() if guard is not None else contextlib.nullcontext():
        env = factory.create(
            args.env, option_strings=strings, session=args.session, wait=args.session_wait,
            restore=args.session_restore, session_idle_timeout=args.session_idle_timeout, **options,
        )
    try:
        yield env
    finally:
        with guard.deferred() if guard is not None else contextlib.nullcontext():
            env.detach()


class SyncProgressBar:
    """Draws a push's progress on a terminal, for pushes large enough to wait for."""

    MIN_BYTES = 4 * 1024 * 1024

    def __init__(self, stream: Any, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self._lock = threading.Lock()

    def __call__(self, p: Any) -> None:
        if p.phase != "push" or p.bytes_total < self.MIN_BYTES:
            return
        with self._lock:
            frac = min(p.bytes_done / p.bytes_total, 1.0) if p.bytes_total else 1.0
            done = int(frac * self.width)
            bar = "#" * done + "-" * (self.width - done)
            end = "\n" if p.bytes_done >= p.bytes_total else ""
            self.stream.write(
                f"\rsyncing [{bar}] {frac:4.0%} {p.files_done}/{p.files_total} files "
                f"{p.bytes_done / 1e6:.1f}/{p.bytes_total / 1e6:.1f} MB{end}"
            )
            self.stream.flush()


# -- helpers --------------------------------------------------------------------------


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the timeout must be positive, got {text!r}")
    return value


def print_table(rows: list[list[str]], indent: str = "") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)] + [row[-1]]
        print(indent + "  ".join(cells).rstrip())
