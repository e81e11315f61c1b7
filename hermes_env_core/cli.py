"""The ``hermes-env`` command: run a command or an interactive shell on any backend, and inspect the setup.

``run`` passes the command's exit status through; errors of hermes-env itself
are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from . import mcp as mcp_cli
from .processes import cli as background_cli
from .environment.base import BaseEnvironment
from .environment.result import ExecResult
from .errors import HermesEnvError
from .factory import EnvironmentFactory
from .plugins.manager import PluginLoadWarning
from .plugins.registry import KNOWN_BACKENDS, BackendRegistry, get_registry
from .plugins.spec import BackendSpec

__all__ = ["main", "build_parser"]

PROG = "hermes-env"
EXIT_USAGE = 2
_SECRET_RE = re.compile(r"password|passphrase|secret|token|api_key|apikey", re.IGNORECASE)
_EXIT_RE = re.compile(r"^\s*exit(?:\s+(\d+))?\s*;?\s*$")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with _one_line_warnings(quiet=getattr(args, "lists_plugins", False)):
        try:
            return int(args.func(args))
        except HermesEnvError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        except BrokenPipeError:
            # stdout went away (| head); exit quietly like other Unix tools
            with contextlib.suppress(Exception):
                sys.stdout = open("/dev/null", "w")  # noqa: SIM115
            return 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run shell commands on local, docker, ssh or plugin backends, as in one long-lived bash."
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

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
    cmd_opts = argparse.ArgumentParser(add_help=False)
    cmd_opts.add_argument("--cwd", metavar="DIR", help="working directory in the target")
    cmd_opts.add_argument("--timeout", metavar="SECONDS", type=_positive_float, help="per-command timeout")

    p = sub.add_parser("run", parents=[env_opts, cmd_opts], help="run one command; its exit status is ours")
    p.add_argument("--stdin", action="store_true", help="pass this process's standard input to the command")
    p.add_argument("--stats", action="store_true", help="after the output, print what the command cost (on stderr)")
    background_cli.add_run_arguments(p)
    p.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command (words are joined by spaces)"
    )
    p.set_defaults(func=_cmd_run)
    background_cli.add_subcommands(sub, parents=[env_opts], environment=_environment)

    p = sub.add_parser("shell", parents=[env_opts, cmd_opts], help="an interactive prompt over one session")
    p.set_defaults(func=_cmd_shell)

    p = sub.add_parser("backends", help="list installed backends and plugins")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_backends, lists_plugins=True)

    p = sub.add_parser("config", parents=[env_opts], help="show the effective options and where each comes from")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("doctor", help="check each installed backend's requirements")
    p.add_argument("names", nargs="*", metavar="NAME", help="backends to check (default: all installed)")
    p.set_defaults(func=_cmd_doctor, lists_plugins=True)
    mcp_cli.add_parser(sub)
    return parser


# -- run and shell -----------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    words = list(args.command)
    if words and words[0] == "--":
        words = words[1:]
    command = words[0] if len(words) == 1 else " ".join(words)
    if not command.strip():
        print(f"{PROG} run: error: no command given", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "background", False):
        with _environment(args) as env:
            return background_cli.run_background(args, env, command)
    stdin = sys.stdin.buffer.read() if args.stdin else None
    with _environment(args) as env:
        result = _execute(env, command, cwd=args.cwd, stdin=stdin, out=sys.stdout)
    _print_notes(result)
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


def _cmd_shell(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    last = 0
    with _environment(args) as env:
        if args.cwd:
            result = env.execute(f"cd -- {_quote(args.cwd)}")
            if result.exit_code != 0:
                print(f"{PROG} shell: error: {result.output.strip() or 'cannot enter ' + args.cwd}", file=sys.stderr)
                return EXIT_USAGE
        while True:
            prompt = f"({env.name}) {env.session.cwd or ''}$ " if interactive else ""
            try:
                line = _read_command(prompt, interactive)
            except EOFError:
                if interactive:
                    print()
                return last
            except KeyboardInterrupt:
                print()  # Ctrl-C at the prompt discards the line, as in bash
                continue
            if not line.strip():
                continue
            match = _EXIT_RE.match(line)
            if match:
                return int(match.group(1)) if match.group(1) else last
            result = _execute(env, line, out=sys.stdout, newline_after=interactive)
            _print_notes(result)
            last = result.exit_code


def _read_command(prompt: str, interactive: bool) -> str:
    lines: list[str] = []
    while True:
        if interactive:
            line = input(prompt if not lines else "> ")
        else:
            raw = sys.stdin.readline()
            if not raw:
                if lines:
                    break
                raise EOFError
            line = raw.rstrip("\n")
        if line.endswith("\\") and not line.endswith("\\\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        break
    return "".join(lines)  # backslash-newline joins lines, as in bash


def _execute(
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


def _print_notes(result: ExecResult) -> None:
    for note in result.notes:
        print(f"{PROG}: {note}", file=sys.stderr)
    if result.interrupted and not result.notes:
        print(f"{PROG}: command cancelled", file=sys.stderr)


@contextlib.contextmanager
def _environment(args: argparse.Namespace) -> Iterator[BaseEnvironment]:
    factory = EnvironmentFactory(config_file=args.config_file)
    options: dict[str, Any] = {}
    if getattr(args, "timeout", None) is not None:
        options["timeout"] = args.timeout
    env = factory.create(args.env, option_strings=dict(args.option), **options)
    if hasattr(env, "sync_progress") and sys.stderr.isatty():
        env.sync_progress = SyncProgressBar(sys.stderr)
    try:
        yield env
    finally:
        env.close()


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


# -- backends ------------------------------------------------------------------------


def _cmd_backends(args: argparse.Namespace) -> int:
    registry = get_registry()
    rows = [_backend_row(registry, spec) for spec in registry.backends.values()]
    failed = [
        {
            "plugin": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "entry_point": p.value,
            "error": p.error,
        }
        for p in registry.failed
    ]
    conflicts = {key: [s.distribution for s in specs] for key, specs in registry.conflicts.items()}
    missing = _not_installed(registry)
    if args.json:
        payload = {"backends": rows, "failed_plugins": failed, "conflicts": conflicts, "not_installed": missing}
        print(json.dumps(payload, indent=2))
        return 0
    table = [["NAME", "ALIASES", "DISTRIBUTION", "VERSION", "STATUS"]]
    for row in rows:
        status = "loadable" if row["loadable"] else f"failed: {row['reason']}"
        table.append(
            [row["name"], ",".join(row["aliases"]) or "-", row["distribution"] or "-", row["version"] or "-", status]
        )
    _print_table(table)
    if failed:
        print("\nplugins that failed to load (their backends are unavailable):")
        for f in failed:
            where = f" {f['version']}" if f["version"] else ""
            print(f"  {f['plugin']} ({f['distribution'] or 'unknown distribution'}{where}): failed: {f['error']}")
    if conflicts:
        print("\nnames provided twice (unusable until one provider is uninstalled):")
        for key, dists in conflicts.items():
            print(f"  {key}: {' and '.join(d or 'a plugin registered in code' for d in dists)}")
    if missing:
        print("\nknown backends not installed:")
        for item in missing:
            print(f"  {item['name']}: {item['install']}")
    print(f"\n(listing imports no backend; `{PROG} doctor` imports each and checks its requirements)")
    return 0


def _backend_row(registry: BackendRegistry, spec: BackendSpec) -> dict[str, Any]:
    info = registry.provider(spec.name)
    loadable, reason = _module_findable(spec)
    if spec.name in registry.conflicts:
        loadable, reason = (
            False,
            "name provided twice: " + " and ".join(s.distribution or "?" for s in registry.conflicts[spec.name]),
        )
    return {
        "name": spec.name,
        "aliases": list(spec.aliases),
        "distribution": spec.distribution,
        "version": info.version if info else None,
        "summary": spec.summary,
        "target": spec.target,
        "loadable": loadable,
        "reason": reason,
    }


def _module_findable(spec: BackendSpec) -> tuple[bool, str | None]:
    # Locates the module without running it: listing must not import backends or SDKs.
    hint = f" ({spec.install_hint})" if spec.install_hint else ""
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError) as exc:
        return False, f"cannot locate {spec.module}: {exc}{hint}"
    if found is None:
        return False, f"module {spec.module} not found{hint}"
    return True, None


def _not_installed(registry: BackendRegistry) -> list[dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for key, known in KNOWN_BACKENDS.items():
        if known.name in registry.backends or key in registry.aliases or key in registry.backends:
            continue
        item = out.setdefault(known.name, {"name": known.name, "install": known.install_hint, "aliases": ""})
        if key != known.name:
            item["aliases"] = ",".join(filter(None, [item["aliases"], key]))
    for item in out.values():
        if item["aliases"]:
            item["name"] = f"{item['name']} ({item['aliases']})"
        del item["aliases"]
    return list(out.values())


# -- config ----------------------------------------------------------------------------


def _cmd_config(args: argparse.Namespace) -> int:
    factory = EnvironmentFactory(config_file=args.config_file)
    resolved = factory.resolve(args.env, option_strings=dict(args.option))
    values = {k: _jsonable(k, v.value) for k, v in resolved.values.items()}
    if args.json:
        payload = {
            "backend": {"value": resolved.backend, "source": resolved.backend_source},
            "config_file": resolved.config_file,
            "options": {k: {"value": values[k], "source": v.source} for k, v in resolved.values.items()},
        }
        print(json.dumps(payload, indent=2))
        return 0
    print(f"backend = {resolved.backend}    ({resolved.backend_source})")
    print(f"config file: {resolved.config_file or 'none'}")
    table = [[f"{k} = {json.dumps(values[k])}", v.source] for k, v in resolved.values.items()]
    _print_table(table, indent="  ")
    return 0


def _jsonable(key: str, value: Any) -> Any:
    if value is not None and _SECRET_RE.search(key):
        return "********"
    if isinstance(value, dict):
        return {str(k): _jsonable(str(k), v) for k, v in value.items()}
    try:
        json.dumps(value)
        return value
    except TypeError:
        if isinstance(value, (tuple, set, frozenset)):
            return [_jsonable("", v) for v in value]
        return str(value)


# -- doctor ----------------------------------------------------------------------------


def _cmd_doctor(args: argparse.Namespace) -> int:
    registry = get_registry()
    names = list(args.names) or registry.names()
    bad = 0
    for name in names:
        try:
            cls = registry.load(name)
        except HermesEnvError as exc:
            print(f"{name}: FAIL: {exc}")
            bad += 1
            continue
        problems = _check(cls)
        if problems:
            bad += 1
            print(f"{name}: {len(problems)} problem(s)")
            for problem in problems:
                print(f"  - {problem}")
        else:
            print(f"{name}: ok")
    if not args.names:
        for info in registry.failed:
            bad += 1
            print(f"plugin {info.name} ({info.source}): FAIL: failed to load: {info.error}")
        for item in _not_installed(registry):
            print(f"{item['name']}: not installed ({item['install']})")
    return 1 if bad else 0


def _check(cls: type[BaseEnvironment]) -> list[str]:
    check = getattr(cls, "check_requirements", None)
    if check is None:
        return []
    try:
        return [str(p) for p in (check() or [])]
    except Exception as exc:
        return [f"check_requirements() raised {type(exc).__name__}: {exc}"]


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


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _print_table(rows: list[list[str]], indent: str = "") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)] + [row[-1]]
        print(indent + "  ".join(cells).rstrip())


@contextlib.contextmanager
def _one_line_warnings(*, quiet: bool) -> Iterator[None]:
    """Plugin warnings as one line each (or not at all where the command lists them anyway)."""
    original = warnings.showwarning

    def show(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, *rest: Any, **kw: Any
    ) -> None:
        if issubclass(category, PluginLoadWarning):
            if not quiet:
                print(f"{PROG}: warning: {message}", file=sys.stderr)
            return
        original(message, category, filename, lineno, *rest, **kw)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


if __name__ == "__main__":
    sys.exit(main())
