"""``hermes-env sessions``: list the named sessions, and ``sessions rm NAME`` to end one."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..environment.named_store import SessionStore
from ..errors import HermesEnvError
from .common import PROG, add_command, factory_for, print_table

__all__ = ["add_commands", "cmd_sessions", "cmd_sessions_rm"]


def add_commands(sub: Any) -> None:
    p = add_command(
        sub,
        "sessions",
        "list named sessions (--session NAME); 'sessions rm NAME' ends one",
        "List the named sessions this user made with --session NAME or create_environment(session=NAME): "
        "backend, target, age, idle time (since last used) and the size of the saved checkpoint.",
    )
    p.set_defaults(func=cmd_sessions)
    rm_sub = p.add_subparsers(title="commands", metavar="COMMAND")
    rm = rm_sub.add_parser("rm", help="end named sessions: their shell (its EXIT trap runs) and, on docker, their container")
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.add_argument("--config-file", metavar="PATH", help="config file (default: $HERMES_ENV_CONFIG, ./hermes-env.toml)")
    rm.set_defaults(func=cmd_sessions_rm)


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def cmd_sessions(args: argparse.Namespace) -> int:
    store = SessionStore()
    names = store.names()
    if not names:
        print(f"no named sessions (start one: {PROG} run --session NAME COMMAND)", file=sys.stderr)
        return 0
    now = time.time()
    rows = [["NAME", "BACKEND", "TARGET", "AGE", "IDLE", "STATE", "IDLE-TIMEOUT"]]
    for name in names:
        record = store.get(name)
        if record is None:
            continue
        size = store.get_state(name)[3]
        rows.append([
            name, record.backend, record.target or "?", _ago(now - record.created), _ago(now - record.last_used),
            f"{size / 1024:.1f}K" if size else "-", f"{record.idle_timeout:g}s" if record.idle_timeout else "-",
        ])
    print_table(rows)
    return 0


def cmd_sessions_rm(args: argparse.Namespace) -> int:
    from ..environment.named import SessionLostError

    store = SessionStore()
    factory = factory_for(args)
    status = 0
    for name in args.names:
        store.require(name)
        try:
            env = factory.create(None, session=name)
        except SessionLostError as exc:
            store.remove(name)
            print(f"{PROG}: session {name!r} removed; it had already ended ({exc})", file=sys.stderr)
            continue
        except HermesEnvError as exc:
            print(f"{PROG}: error: session {name!r}: {exc}", file=sys.stderr)
            status = 1
            continue
        env.close()
        print(f"{PROG}: session {name!r} ended", file=sys.stderr)
    return status
