"""The ``hermes-env`` commands for background processes: ``run --background``, ``ps``/``rm``/``prune`` (in
``listing``), ``logs``, ``kill``, ``wait``.

Each CLI call is a new Python process, so processes started from the CLI run
detached and are found again through the checkpoint file
(``$HERMES_ENV_PROCESSES_FILE``, else ``~/.local/state/hermes-env/processes.json``).
A detached process keeps its environment alive: a backend whose target would
go away at close (docker) is opened so that it stays (``background_options``),
under a task id of its own, and how to open it again is kept next to the
checkpoint (``processes.envs.json``, without secrets). ``ps``, ``logs``,
``kill`` and ``wait`` reopen it; once no process runs there, the target is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from pydantic import SecretBytes, SecretStr

from ..environment.base import BaseEnvironment
from ..errors import HermesEnvError, UsageError
from . import listing
from .checkpoint import default_checkpoint_path
from .events import NotificationKind
from .process import BackgroundProcess, ProcessError, ProcessStatus
from .registry import ProcessRegistry, env_key
from .sandbox import SandboxDriver
from .watch import LineMatcher, WatchPattern

__all__ = ["add_run_arguments", "add_subcommands", "keep_alive", "main", "run_background"]

EnvironmentOpener = Callable[[argparse.Namespace], AbstractContextManager[BaseEnvironment]]
STATUS_UNKNOWN = "unknown"
_SECRET_RE = re.compile(r"password|passphrase|secret|token|api_key|apikey", re.IGNORECASE)
_LOG_CHUNK = 8 * 1024 * 1024
#: Options never written to the reopen file: variables for commands may hold secrets, and checking
#: a process does not need them (a docker container is found again by its task id alone).
_NOT_KEPT = frozenset({"env"})


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
    """Add ``ps``, ``rm``, ``prune``, ``logs``, ``kill`` and ``wait``. ``parents`` carry the environment options (``--env``, ``-o``);
    ``environment(args)`` opens the environment they name (default: ``create_environment``)."""
    opener = environment or _default_environment
    listing.add_commands(subparsers, parents, opener)
    p = subparsers.add_parser(
        "logs", parents=list(parents), help="print a background process's output",
        description="Print the full output of background process ID, kept in its target while it runs and after. "
        "Lines that matched its --watch patterns are summarized on stderr; --matches prints only those.",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until it exits")
    p.add_argument("--matches", action="store_true", help="print only the lines that matched a --watch pattern")
    p.set_defaults(func=lambda a: cmd_logs(a, opener))
    p = subparsers.add_parser(
        "kill", parents=list(parents), help="end a background process and its children",
        description="End background process ID and every process it started (SIGTERM, then SIGKILL), or send it "
        "one signal with -s. Exits 1 if it was not running.",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("-s", "--signal", metavar="SIG", help="send only this signal to the process (e.g. INT, HUP)")
    p.set_defaults(func=lambda a: cmd_kill(a, opener))
    p = subparsers.add_parser(
        "wait", parents=list(parents), help="wait for a background process to exit or match its --watch",
        description="Block until background process ID prints a line matching one of its --watch patterns "
        "(exit 0, the line printed; a match already in its output counts) or exits (its exit status, as "
        "bash's wait). --timeout gives up with exit status 124.",
    )
    p.add_argument("id", metavar="ID")
    p.add_argument("--timeout", metavar="SECONDS", type=float, help="give up after this long (exit status 124)")
    p.set_defaults(func=lambda a: cmd_wait(a, opener))


@contextlib.contextmanager
def _default_environment(args: argparse.Namespace) -> Iterator[BaseEnvironment]:
    from ..factory import create_environment

    options = dict(getattr(args, "option", None) or [])
    env = create_environment(getattr(args, "env", None), **options)
    try:
        yield env
    finally:
        env.close()


# -- environments that outlive the command --------------------------------------------------------


def keep_alive(
    factory: Any, resolved: Any, name: str | None, option_strings: dict[str, str], options: dict[str, Any]
) -> Any:
    """The configuration of an environment a detached process must outlive.

    A backend says what keeps its target after close in ``background_options``
    (docker: ``{"persistent": True}``; local and ssh need nothing). The task id,
    unless given, becomes ``bg-<random>``: one target per background process.
    """
    cls = factory.registry.load(resolved.backend)
    extra = getattr(cls, "background_options", None)
    if extra is None:
        print(
            f"hermes-env: warning: backend {resolved.backend!r} does not say how to keep its target alive after "
            "this command; the process may end when it closes",
            file=sys.stderr,
        )
        return resolved
    extra = {k: v for k, v in dict(extra).items() if getattr(resolved.config, k, None) != v}
    if extra and resolved.values["task_id"].source == "default":
        extra["task_id"] = "bg-" + os.urandom(4).hex()
    if not extra:
        return resolved
    return factory.resolve(name, option_strings=option_strings, **{**options, **extra})


def _envs_path() -> Path:
    cp = default_checkpoint_path()
    return cp.with_name(cp.stem + ".envs.json")


@contextlib.contextmanager
def _envs_locked() -> Iterator[dict[str, Any]]:
    """The saved ways to reopen environments, by env key; written back atomically on the way out."""
    path = _envs_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            data = {}
        before = json.dumps(data, sort_keys=True)
        yield data
        if json.dumps(data, sort_keys=True) != before:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=1)
            os.replace(tmp, path)


def _load_envs() -> dict[str, Any]:
    with _envs_locked() as data:
        return dict(data)


def _reopen_record(env: BaseEnvironment) -> dict[str, Any]:
    """What reopens ``env``: its backend and the options that differ from the defaults, never a secret."""
    cfg = env.config
    options: dict[str, Any] = {}
    dumped = cfg.model_dump(mode="json")
    for key, field in type(cfg).model_fields.items():
        value = getattr(cfg, key)
        if value == field.get_default(call_default_factory=True) or _SECRET_RE.search(key) or key in _NOT_KEPT:
            continue
        if isinstance(value, (SecretStr, SecretBytes)):
            continue
        options[key] = dumped[key]
    return {"backend": env.name, "options": options}


def _save_env(env: BaseEnvironment, *, owned: bool) -> None:
    record = _reopen_record(env)
    record["owned"] = owned
    with _envs_locked() as data:
        old = data.get(env_key(env))
        if old is not None:
            record["owned"] = bool(old.get("owned")) or owned
        data[env_key(env)] = record


@contextlib.contextmanager
def _reopen(key: str, envs: dict[str, Any]) -> Iterator[tuple[BaseEnvironment | None, str | None]]:
    """Open the environment of ``key`` again, if it can be; else (None, why not)."""
    from ..factory import create_environment
    from ..plugins.registry import get_registry

    entry = envs.get(key)
    if entry is None and key == "local":
        entry = {"backend": "local", "options": {}}
    if entry is None:
        yield None, f"not checked: it runs in {key}, and how to open that environment was not recorded"
        return
    try:
        cls = get_registry().load(entry["backend"])
        exists = getattr(cls, "target_exists", None)
        if exists is not None:
            config = get_registry().config_model(entry["backend"]).model_validate(entry["options"])
            if not exists(config):
                yield None, f"its environment {key} is gone"
                return
        env = create_environment(entry["backend"], **entry["options"])
    except HermesEnvError as exc:
        yield None, f"not checked: cannot open {key}: {exc}"
        return
    try:
        yield env, None
    finally:
        env.close()


def _remove_if_done(env: BaseEnvironment, reg: ProcessRegistry, envs: dict[str, Any]) -> None:
    """Remove a target kept for background processes once none runs there; their output is kept here first."""
    key = env_key(env)
    entry = envs.get(key)
    if not entry or not entry.get("owned"):
        return
    if any(p.running for p in reg.list(env)) or any(r.get("env_key") == key for r in reg.pending):
        return
    for proc in reg.list(env):
        driver = proc._driver
        if isinstance(driver, SandboxDriver):
            with contextlib.suppress(ProcessError, HermesEnvError, OSError):
                _keep_log(proc.id, _full_log(driver))
    _remove_target(env)
    with _envs_locked() as data:
        data.pop(key, None)


def _keep_log(process_id: str, data: bytes) -> None:
    path = _saved_log(process_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


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
    owned = str(env.task_id).startswith("bg-") and bool(getattr(env.config, "persistent", False))
    try:
        with _registry() as reg:
            proc = reg.spawn(env, command, detached=True, pty=bool(getattr(args, "pty", False)), watch=watch,
                             cwd=getattr(args, "cwd", None))
    except BaseException:
        if owned:
            # Made for this process alone (a container and its volume): nothing of it may stay behind.
            _remove_target(env)
        raise
    print(f"{proc.id} pid {proc.pid}")
    _save_env(env, owned=owned)
    return 0


def _remove_target(env: BaseEnvironment) -> None:
    cleanup = getattr(env, "cleanup", None)
    if cleanup is not None and "force" in inspect.signature(cleanup).parameters:
        with contextlib.suppress(HermesEnvError):
            cleanup(force=True)


# -- finding a process again ------------------------------------------------------------------


class _Found:
    """One process as found: followed again (``proc``), or only as recorded (``rec``) with a reason."""

    def __init__(self, proc: BackgroundProcess | None, rec: dict[str, Any] | None, why: str | None = None) -> None:
        self.proc, self.rec, self.why = proc, rec, why
        self.driver: SandboxDriver | None = None


def _driver_of(env: BaseEnvironment, rec: dict[str, Any]) -> SandboxDriver | None:
    try:
        return SandboxDriver(env, dir=str(rec["dir"]), pid=(int(rec["pid"]), int(rec["start_time"])),
                             wrapper=(int(rec["wrapper_pid"]), int(rec["wrapper_start"])), pty=bool(rec.get("pty")))
    except (KeyError, TypeError, ValueError):
        return None


@contextlib.contextmanager
def _checked(
    args: argparse.Namespace,
    opener: EnvironmentOpener,
    only: str | None = None,
    select: Callable[[dict[str, Any]], bool] | None = None,
) -> Iterator[tuple[ProcessRegistry, dict[str, _Found], dict[str, BaseEnvironment]]]:
    """Recover every live process (or only ``only``, or those ``select`` takes) in its own environment,
    reopened; the rest as recorded.

    An environment given with options on the command line (``-o``) is opened
    as given and used for the processes that run in it, in place of the
    recorded way to reopen it. ``--env NAME`` alone is opened only for
    processes whose way to reopen was not recorded (started from Python).
    """
    envs = _load_envs()
    found: dict[str, _Found] = {}
    opened: dict[str, BaseEnvironment] = {}
    given: list[Any] = []  # [env or None, why]: opened once, when needed

    def open_given() -> None:
        if given:
            return
        try:
            env = stack.enter_context(opener(args))
        except HermesEnvError as exc:
            given.extend([None, f"not checked: cannot open the environment given on the command line: {exc}"])
            return
        given.extend([env, None])
        opened[env_key(env)] = env

    # Environments close after the registry is released: closing one must not touch what it follows.
    with contextlib.ExitStack() as stack, _registry() as reg:
        if getattr(args, "option", None):
            given.append(stack.enter_context(opener(args)))
            opened[env_key(given[0])] = given[0]
        records = [r for r in reg.pending if (only is None or r["id"] == only)
                   and (select is None or select(listing.row_of(r)))]
        for key in sorted({str(r.get("env_key")) for r in records}):
            if key not in opened and key not in envs and key != "local" and getattr(args, "env", None):
                open_given()
            env, why = (opened[key], None) if key in opened else stack.enter_context(_reopen(key, envs))
            mine = [r for r in records if r.get("env_key") == key]
            if env is None:
                gone = bool(why and why.endswith("is gone"))
                for r in mine:
                    status = ProcessStatus.LOST.value if gone else STATUS_UNKNOWN
                    found[r["id"]] = _Found(None, {**r, "status": status}, why)
                continue
            opened[key] = env
            try:
                reg.recover(env)
            except (ProcessError, HermesEnvError) as exc:
                for r in mine:
                    found[r["id"]] = _Found(None, {**r, "status": STATUS_UNKNOWN}, f"not checked: {exc}")
                continue
            for r in reg.pending:  # still pending: the target did not answer for it
                if r.get("env_key") == key and r["id"] not in found:
                    found[r["id"]] = _Found(None, {**r, "status": STATUS_UNKNOWN}, "not checked: its environment did not answer")
        for p in reg.list():
            found[p.id] = _Found(p, None)
        for rec in reg.history:
            if rec["id"] not in found and (only is None or rec["id"] == only):
                found[rec["id"]] = _Found(None, rec)
                key = str(rec.get("env_key"))
                if only is not None and rec.get("driver") == "sandbox" and not _saved_log(only).exists():
                    # Ended, but its output is still in its target: open that to read it.
                    env = opened.get(key)
                    if env is None:
                        env, why = stack.enter_context(_reopen(key, envs))
                    if env is not None:
                        opened[key] = env
                        found[rec["id"]].driver = _driver_of(env, rec)
        yield reg, found, opened
        for env in opened.values():
            _remove_if_done(env, reg, envs)


def _forget_files(ids: Sequence[str], found: dict[str, _Found], opened: dict[str, BaseEnvironment]) -> None:
    """Remove what ``rm``/``prune`` forgot: the output kept here, and the process's directory in its target."""
    envs = _load_envs()
    with contextlib.ExitStack() as stack:
        for pid_id in ids:
            _saved_log(pid_id).unlink(missing_ok=True)
            rec = found[pid_id].rec or {}
            if rec.get("driver") != "sandbox":
                continue
            key = str(rec.get("env_key"))
            env = opened.get(key)
            if env is None and (key in envs or key == "local"):
                env, _ = stack.enter_context(_reopen(key, envs))
            driver = _driver_of(env, rec) if env is not None else None
            if driver is not None:
                with contextlib.suppress(HermesEnvError, ProcessError):
                    driver.remove()


def _saved_log(process_id: str) -> Path:
    return default_checkpoint_path().parent / "logs" / f"{process_id}.log"


def _find(process_id: str, found: dict[str, _Found]) -> _Found:
    item = found.get(process_id)
    if item is None:
        raise UsageError(f"no background process {process_id!r} (see `hermes-env ps`)")
    return item


def _driver(item: _Found) -> SandboxDriver | None:
    if item.driver is not None:
        return item.driver
    if item.proc is not None:
        d = item.proc._driver
        return d if isinstance(d, SandboxDriver) else None
    return None


def _matches(patterns: Sequence[WatchPattern], data: bytes) -> list[tuple[WatchPattern, str]]:
    if not patterns:
        return []
    matcher = LineMatcher(patterns)
    return matcher.feed(data) + matcher.flush()


def _full_log(driver: SandboxDriver, end: int | None = None) -> bytes:
    out, offset = bytearray(), 0
    while end is None or offset < end:
        want = _LOG_CHUNK if end is None else min(_LOG_CHUNK, end - offset)
        data = driver.read_log(offset, want)
        out += data
        offset += len(data)
        if len(data) < want:
            break
    return bytes(out)


# -- ps, logs, kill, wait ---------------------------------------------------------------------


def cmd_logs(args: argparse.Namespace, opener: EnvironmentOpener) -> int:
    out = sys.stdout.buffer
    with _checked(args, opener, args.id) as (_, found, _opened):
        item = _find(args.id, found)
        proc, driver = item.proc, _driver(item)
        saved = _saved_log(args.id)
        if driver is not None:
            data = _full_log(driver)
        elif saved.exists():
            data = saved.read_bytes()  # its environment was removed when it ended
        else:
            why = item.why or "its output was not kept (it ran on a pipe owned by another process)"
            raise HermesEnvError(f"cannot read the output of {args.id}: {why}")
        record = item.rec or {}
        patterns = proc.patterns if proc else tuple(WatchPattern.from_record(w) for w in record.get("watch") or ())
        hits = _matches(patterns, data)
        if args.matches:
            for pattern, line in hits:
                out.write(f"{pattern}: {line}\n".encode())
            out.flush()
            return 0 if hits else 1
        out.write(data)
        out.flush()
        offset = len(data)
        if args.follow and proc is not None and driver is not None and proc.running:
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
        if hits and not args.follow:
            shown = ", ".join(sorted({str(p) for p, _ in hits}))
            print(f"hermes-env: {len(hits)} line(s) matched --watch {shown} (hermes-env logs --matches {args.id})",
                  file=sys.stderr)
    return 0


def cmd_kill(args: argparse.Namespace, opener: EnvironmentOpener) -> int:
    with _checked(args, opener, args.id) as (_, found, _opened):
        item = _find(args.id, found)
        proc = item.proc
        if proc is None and item.rec and item.rec.get("status") == STATUS_UNKNOWN:
            raise HermesEnvError(f"cannot kill {args.id}: {item.why}")
        if proc is None or not proc.running:
            status = proc.status.value if proc is not None else (item.rec or {}).get("status", "finished")
            print(f"{args.id}: not running ({status})", file=sys.stderr)
            return 1
        if args.signal:
            proc.send_signal(args.signal)
            print(f"{args.id}: sent SIG{args.signal.upper().removeprefix('SIG')}")
            return 0
        code = proc.kill()
        print(f"{args.id}: {proc.status.value} (exit code {code})")
    return 0


def cmd_wait(args: argparse.Namespace, opener: EnvironmentOpener) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    with _checked(args, opener, args.id) as (reg, found, _opened):
        item = _find(args.id, found)
        proc = item.proc
        if proc is None:
            rec = item.rec or {}
            if rec.get("status") == STATUS_UNKNOWN:
                raise HermesEnvError(f"cannot wait for {args.id}: {item.why}")
            code = rec.get("exit_code")
            print(f"[{args.id}] {rec.get('status', 'finished')} (exit code {'unknown' if code is None else code})")
            return int(code) if isinstance(code, int) else 125
        driver = _driver(item)
        if driver is not None and proc.patterns:
            hits = _matches(proc.patterns, _full_log(driver, driver.offset))
            if hits:
                pattern, line = hits[0]
                print(f"[{args.id}] matched {str(pattern)!r}: {line}")
                return 0
        while proc.running:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                print(f"hermes-env: {args.id} still running after {args.timeout:g}s", file=sys.stderr)
                return 124
            note = reg.next_notification(timeout=min(left, 1.0) if left is not None else 1.0)
            if note is None or note.process_id != args.id:
                continue
            if note.kind is NotificationKind.MATCH:
                print(f"[{args.id}] matched {note.pattern!r}: {note.text}")
                return 0
            if note.kind in (NotificationKind.EXIT, NotificationKind.LOST):
                break
        code = proc.exit_code
        print(f"[{args.id}] {proc.status.value} (exit code {'unknown' if code is None else code})")
        return code if code is not None else 125


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry (``python -m hermes_env_core.processes.cli``); the main CLI wires these in too."""
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
        return 2 if isinstance(exc, UsageError) else 125


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
