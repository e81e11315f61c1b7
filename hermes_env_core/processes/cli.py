"""The ``hermes-env`` commands for background processes: ``run --background``, ``ps``, ``logs``, ``kill``.

Each CLI call is a new Python process, so processes started from the CLI run
detached and are found again through the checkpoint file
(``$HERMES_ENV_PROCESSES_FILE``, else ``~/.local/state/hermes-env/processes.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..environment.base import BaseEnvironment
from ..errors import HermesEnvError
from .checkpoint import default_checkpoint_path
from .process import BackgroundProcess, ProcessStatus
from .registry import ProcessRegistry, env_key
from .sandbox import SandboxDriver
from .watch import WatchPattern

__all__ = ["add_run_arguments", "add_subcommands", "main", "run_background"]

EnvironmentOpener = Callable[[argparse.Namespace], AbstractContextManager[BaseEnvironment]]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--background``, ``--watch``, ``--watch-regex`` and ``--pty`` to the ``run`` parser."""
    g = parser.add_argument_group("background")
    g.add_argument("--background", action="store_true", help="start the command detached; print its id and return")
    g.add_argument("--watch", metavar="TEXT", action="append", default=[], help="(with --background) watch for lines containing TEXT")
    g.add_argument("--watch-regex", metavar="REGEX", action="append", default=[], help="(with --background) watch for lines matching REGEX")
    g.add_argument("--pty", action="store_true", help="(with --background) run it on a pseudo-terminal")


def add_subcommands(
    subparsers: argparse._SubParsersAction,  # type: ignore[type-arg]
    *,
    parents: Sequence[argparse.ArgumentParser] = (),
    environment: EnvironmentOpener | None = None,
) -> None:
    """Add ``ps``, ``logs`` and ``kill``. ``parents`` carry the environment options (``--env``, ``-o``);
    ``environment(args)`` opens the environment they name (default: ``create_environment``)."""
    opener = environment or _default_environment
    p = subparsers.add_parser("ps", parents=list(parents), help="list background processes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=lambda a: cmd_ps(a, opener))
    p = subparsers.add_parser("logs", parents=list(parents), help="print a background process's output")
    p.add_argument("id", metavar="ID")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until it exits")
    p.set_defaults(func=lambda a: cmd_logs(a, opener))
    p = subparsers.add_parser("kill", parents=list(parents), help="end a background process and its children")
    p.add_argument("id", metavar="ID")
    p.add_argument("-s", "--signal", metavar="SIG", help="send only this signal to the process (e.g. INT, HUP)")
    p.set_defaults(func=lambda a: cmd_kill(a, opener))


@contextlib.contextmanager
def _default_environment(args: argparse.Namespace) -> Iterator[BaseEnvironment]:
    from ..factory import create_environment

    options = dict(getattr(args, "option", None) or [])
    env = create_environment(getattr(args, "env", None), **options)
    try:
        yield env
    finally:
        env.close()


@contextlib.contextmanager
def _registry(env: BaseEnvironment | None = None) -> Iterator[ProcessRegistry]:
    reg = ProcessRegistry(checkpoint=default_checkpoint_path())
    try:
        if env is not None:
            reg.recover(env)
        yield reg
    finally:
        reg.release()  # a CLI command never kills what it merely looked at


def run_background(args: argparse.Namespace, env: BaseEnvironment, command: str) -> int:
    """``run --background``: start ``command`` detached in ``env``; print ``ID pid PID``."""
    watch = [WatchPattern(w) for w in getattr(args, "watch", []) or []]
    watch += [WatchPattern(w, regex=True) for w in getattr(args, "watch_regex", []) or []]
    with _registry() as reg:
        proc = reg.spawn(env, command, detached=True, pty=bool(getattr(args, "pty", False)), watch=watch, cwd=getattr(args, "cwd", None))
        print(f"{proc.id} pid {proc.pid}")
    return 0


def cmd_ps(args: argparse.Namespace, opener: EnvironmentOpener) -> int:
    with opener(args) as env, _registry(env) as reg:
        key = env_key(env)
        rows = []
        for p in reg.list():
            row = _row_of(p.info().__dict__)
            row["waiting_for_input"] = p.waiting_for_input or p.check_waiting_for_input(reg.input_wait_s or 2.0)
            rows.append(row)
        seen = {r["id"] for r in rows}
        # Processes of other environments: as recorded, not checked.
        for rec in reg.pending:
            if rec["id"] not in seen:
                rows.append(_row_of(rec, note=f"not checked: runs in {rec.get('env_key')}, not {key}"))
                seen.add(rec["id"])
        for rec in reg.history:
            if rec["id"] not in seen:
                rows.append(_row_of(rec))
    rows.sort(key=lambda r: r["started_at"] or 0)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [["ID", "STATUS", "PID", "EXIT", "WHERE", "STARTED", "COMMAND"]]
    for r in rows:
        started = time.strftime("%H:%M:%S", time.localtime(r["started_at"])) if r["started_at"] else "-"
        status = "waiting-input" if r.get("waiting_for_input") else r["status"]
        table.append([r["id"], status, str(r["pid"] or "-"), "-" if r["exit_code"] is None else str(r["exit_code"]),
                      r["where"], started, r["command"].replace("\n", " ")[:60]])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _row_of(rec: dict[str, Any], note: str | None = None) -> dict[str, Any]:
    status = rec.get("status")
    return {
        "id": rec["id"],
        "status": status.value if isinstance(status, ProcessStatus) else str(status or "running"),
        "pid": rec.get("pid"),
        "exit_code": rec.get("exit_code"),
        "where": rec.get("env_key") or (rec.get("backend") if rec.get("backend") == "local" else f"{rec.get('backend')}:{rec.get('task_id')}"),
        "started_at": rec.get("started_at"),
        "command": str(rec.get("command", "")),
        "note": note or rec.get("note"),
    }


def _find(reg: ProcessRegistry, env: BaseEnvironment, process_id: str) -> tuple[BackgroundProcess | None, dict[str, Any] | None]:
    if process_id in reg:
        return reg.get(process_id), None
    for rec in reg.pending + reg.history:
        if rec["id"] == process_id:
            if rec.get("env_key") != env_key(env):
                raise HermesEnvError(
                    f"background process {process_id} runs in {rec.get('env_key')}; "
                    f"open that environment (--env {rec.get('backend')} -o task_id={rec.get('task_id')})"
                )
            return None, rec
    raise HermesEnvError(f"no background process {process_id!r} (see `hermes-env ps`)")


def cmd_logs(args: argparse.Namespace, opener: EnvironmentOpener) -> int:
    out = sys.stdout.buffer
    with opener(args) as env, _registry(env) as reg:
        proc, rec = _find(reg, env, args.id)
        driver = proc._driver if proc is not None else None
        if rec is not None and rec.get("driver") == "sandbox":
            driver = SandboxDriver(env, dir=rec["dir"], pid=(rec["pid"], rec["start_time"]),
                                   wrapper=(rec["wrapper_pid"], rec["wrapper_start"]), pty=bool(rec.get("pty")))
        if not isinstance(driver, SandboxDriver):
            print(f"hermes-env: the output of {args.id} is not kept on disk (it ran on a pipe owned by another process)",
                  file=sys.stderr)
            return 1
        offset = 0
        while True:
            data = driver.read_log(offset, 8 * 1024 * 1024)
            out.write(data)
            offset += len(data)
            if len(data) < 8 * 1024 * 1024:
                break
        out.flush()
        if args.follow and proc is not None and proc.running:
            pos = offset
            while True:
                chunk = proc.read(pos)
                data = driver.read_log(pos, chunk.offset - pos) if chunk.dropped else b""
                out.write(data + chunk.data)
                out.flush()
                pos = chunk.next_offset
                if not proc.running and pos >= proc.output_end:
                    break
                proc._buffer.wait(pos, 1.0)
    return 0


def cmd_kill(args: argparse.Namespace, opener: EnvironmentOpener) -> int:
    with opener(args) as env, _registry(env) as reg:
        proc, rec = _find(reg, env, args.id)
        if proc is None or not proc.running:
            status = proc.status.value if proc is not None else (rec or {}).get("status", "finished")
            print(f"{args.id}: not running ({status})", file=sys.stderr)
            return 1
        if args.signal:
            proc.send_signal(args.signal)
            print(f"{args.id}: sent SIG{args.signal.upper().removeprefix('SIG')}")
            return 0
        code = proc.kill()
        print(f"{args.id}: {proc.status.value} (exit code {code})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry (``python -m hermes_env_core.processes.cli``) until the main CLI wires these in."""
    parser = argparse.ArgumentParser(prog="hermes-env-processes")
    env_opts = argparse.ArgumentParser(add_help=False)
    env_opts.add_argument("--env", metavar="NAME")
    env_opts.add_argument("-o", "--option", metavar="KEY=VALUE", action="append", default=[], type=_key_value)
    sub = parser.add_subparsers(metavar="COMMAND")
    run = sub.add_parser("run", parents=[env_opts])
    run.add_argument("--cwd")
    add_run_arguments(run)
    run.add_argument("command", nargs=argparse.REMAINDER)

    def do_run(a: argparse.Namespace) -> int:
        if not a.background:
            print("hermes-env-processes: only `run --background` is handled here", file=sys.stderr)
            return 2
        with _default_environment(a) as env:
            return run_background(a, env, " ".join(a.command))

    run.set_defaults(func=do_run)
    add_subcommands(sub, parents=[env_opts])
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except HermesEnvError as exc:
        print(f"hermes-env: error: {exc}", file=sys.stderr)
        return 2


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


if __name__ == "__main__":
    raise SystemExit(main())
