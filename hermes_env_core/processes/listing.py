"""``hermes-env ps``, ``rm`` and ``prune``: list background processes, and forget the ended ones.

As with ``docker ps``: running processes by default (and those whose state
cannot be checked now), ``--all`` for every one still listed; ``rm`` forgets
ended ones by id (``--force`` kills a running one first), ``prune`` every
ended one. ``--env NAME`` (and ``-o task_id=…``/``host=…``/``user=…``) narrows
each of them to one backend or target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import HermesEnvError, UsageError
from .process import ProcessError, ProcessStatus
from .watch import WatchPattern

__all__ = ["add_commands", "cmd_prune", "cmd_ps", "cmd_rm"]

#: statuses of a process that will not run again
ENDED = frozenset({ProcessStatus.EXITED.value, ProcessStatus.KILLED.value, ProcessStatus.LOST.value})


def add_commands(
    subparsers: argparse._SubParsersAction,  # type: ignore[type-arg]
    parents: Sequence[argparse.ArgumentParser],
    opener: Any,
) -> None:
    p = subparsers.add_parser(
        "ps", parents=list(parents), help="list background processes",
        description="List background processes started with `run --background`: status (running, or unknown with "
        "the reason when its environment cannot be checked; with --all also exited, killed and lost), pid, exit "
        "code, where it runs, and the matches of its --watch patterns. --env NAME lists only that backend's "
        "(-o task_id=, host=, user= narrow it further).",
    )
    p.add_argument("-a", "--all", action="store_true", help="also list processes that ended")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=lambda a: cmd_ps(a, opener))
    p = subparsers.add_parser(
        "rm", parents=list(parents), help="forget ended background processes",
        description="Forget background processes ID... that ended: their line in `ps --all`, their kept output and "
        "their files in the target. A running one (or one that cannot be checked) is refused unless --force, "
        "which ends it first. Exits 1 if any was refused.",
    )
    p.add_argument("ids", nargs="+", metavar="ID")
    p.add_argument("-f", "--force", action="store_true", help="end a running process first (SIGTERM, then SIGKILL)")
    p.set_defaults(func=lambda a: cmd_rm(a, opener))
    p = subparsers.add_parser(
        "prune", parents=list(parents), help="forget every ended background process",
        description="Forget every background process that exited, was killed or was lost (only those of --env's "
        "backend when given), as `rm` does for one. Running ones and ones that cannot be checked are kept.",
    )
    p.set_defaults(func=lambda a: cmd_prune(a, opener))


# -- which processes --env and -o name ----------------------------------------------------------------


def selector(args: argparse.Namespace) -> Callable[[dict[str, Any]], bool]:
    """A test on a ``ps`` row for ``--env NAME`` and the ``-o`` options that name a target."""
    name = getattr(args, "env", None)
    options = dict(getattr(args, "option", None) or [])
    if not name:
        return lambda row: True
    from ..plugins.registry import get_registry

    backend = get_registry().canonical(name)  # an unknown name is a usage error, with "did you mean"
    task_id = options.get("task_id")
    host, user, port = options.get("host"), options.get("user"), options.get("port")

    def wanted(row: dict[str, Any]) -> bool:
        if row.get("backend") != backend:
            return False
        where = str(row.get("where") or "")
        if task_id is not None and row.get("task_id") != str(task_id) and where != f"{backend}:{task_id}":
            return False
        account = where.partition(":")[2]
        login, _, address = account.rpartition("@")
        if user is not None and login != str(user):
            return False
        if host is not None and address.split(":")[0] != str(host):
            return False
        return port is None or address.endswith(f":{port}")

    return wanted


# -- ps -------------------------------------------------------------------------------------------


def _rows(found: dict[str, Any], reg: Any) -> list[dict[str, Any]]:
    from .cli import _driver, _full_log, _matches, _saved_log

    rows = []
    for item in found.values():
        if item.proc is not None:
            row = row_of(item.proc.info().__dict__)
            row["waiting_for_input"] = item.proc.waiting_for_input or (
                item.proc.running and item.proc.check_waiting_for_input(reg.input_wait_s or 2.0)
            )
            driver = _driver(item)
            hits: list[tuple[WatchPattern, str]] = []
            if driver is not None and item.proc.patterns:
                with contextlib.suppress(ProcessError, HermesEnvError):
                    hits = _matches(item.proc.patterns, _full_log(driver))
            row["watch"] = [str(p) for p in item.proc.patterns]
            row["matches"] = [{"pattern": str(p), "line": line} for p, line in hits[-20:]]
            row["match_count"] = len(hits)
        else:
            row = row_of(item.rec or {}, note=item.why)
            saved = _saved_log(row["id"])
            if row["watch"] and saved.exists():
                hits = _matches([WatchPattern.from_record(w) for w in (item.rec or {}).get("watch") or ()],
                                saved.read_bytes())
                row["matches"] = [{"pattern": str(p), "line": line} for p, line in hits[-20:]]
                row["match_count"] = len(hits)
        rows.append(row)
    rows.sort(key=lambda r: r["started_at"] or 0)
    return rows


def cmd_ps(args: argparse.Namespace, opener: Any) -> int:
    from .cli import _checked

    wanted = selector(args)
    with _checked(args, opener, select=wanted) as (reg, found, _):
        rows = [r for r in _rows(found, reg) if wanted(r)]
    if not args.all:
        rows = [r for r in rows if r["status"] not in ENDED]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [["ID", "STATUS", "PID", "EXIT", "WHERE", "STARTED", "WATCH", "COMMAND"]]
    for r in rows:
        started = time.strftime("%H:%M:%S", time.localtime(r["started_at"])) if r["started_at"] else "-"
        status = "waiting-input" if r.get("waiting_for_input") else r["status"]
        table.append([r["id"], status, str(r["pid"] or "-"), "-" if r["exit_code"] is None else str(r["exit_code"]),
                      r["where"], started, _watch_cell(r), r["command"].replace("\n", " ")[:60]])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    notes = [(r["id"], r["note"]) for r in rows if r["status"] in ("unknown", "lost") and r.get("note")]
    for pid_id, note in notes:
        print(f"{pid_id}: {note}")
    return 0


def _watch_cell(row: dict[str, Any]) -> str:
    if not row.get("watch"):
        return "-"
    count = row.get("match_count", 0)
    if not count:
        return "no match"
    last = row["matches"][-1]["line"].strip()
    return f"{count}x {last[:40]!r}"


def row_of(rec: dict[str, Any], note: str | None = None) -> dict[str, Any]:
    """One process as ``ps --json`` prints it, from a checkpoint record or a ``ProcessInfo``."""
    status = rec.get("status")
    return {
        "id": rec["id"],
        "status": status.value if isinstance(status, ProcessStatus) else str(status or "unknown"),
        "pid": rec.get("pid"),
        "exit_code": rec.get("exit_code"),
        "where": rec.get("env_key") or (rec.get("backend") if rec.get("backend") == "local" else f"{rec.get('backend')}:{rec.get('task_id')}"),
        "backend": rec.get("backend"),
        "task_id": rec.get("task_id"),
        "started_at": rec.get("started_at"),
        "command": str(rec.get("command", "")),
        "note": note or rec.get("note"),
        "watch": [str(WatchPattern.from_record(w)) for w in rec.get("watch") or ()],
        "matches": [],
        "match_count": 0,
        "waiting_for_input": False,
    }


# -- rm, prune ------------------------------------------------------------------------------------


def cmd_rm(args: argparse.Namespace, opener: Any) -> int:
    ids = list(dict.fromkeys(args.ids))
    return _forget(args, opener, ids, force=args.force)


def cmd_prune(args: argparse.Namespace, opener: Any) -> int:
    return _forget(args, opener, None, force=False)


def _forget(args: argparse.Namespace, opener: Any, ids: list[str] | None, *, force: bool) -> int:
    """Forget ``ids`` (None: every ended process ``--env`` selects); 1 if any was refused."""
    from .cli import _checked, _forget_files

    wanted = selector(args)
    refused: list[str] = []
    with _checked(args, opener, select=wanted) as (reg, found, opened):
        rows = {r["id"]: r for r in _rows(found, reg)}
        if ids is not None:
            unknown = [i for i in ids if i not in rows]
            if unknown:
                raise UsageError(
                    f"no background process {', '.join(map(repr, unknown))} (see `hermes-env ps --all`)"
                )
            outside = [i for i in ids if not wanted(rows[i])]
            if outside:
                raise UsageError(f"{', '.join(outside)}: not in the environment --env names (it runs in "
                                 f"{rows[outside[0]]['where']})")
            chosen = ids
        else:
            chosen = [i for i, r in rows.items() if wanted(r) and r["status"] in ENDED]
        gone: list[str] = []
        for pid_id in chosen:
            item, status = found[pid_id], rows[pid_id]["status"]
            if status not in ENDED:
                proc = item.proc
                if not force:
                    why = "is running" if status == "running" else f"cannot be checked ({item.why})"
                    print(f"hermes-env: {pid_id} {why}; end it first (`hermes-env kill {pid_id}`) or use --force",
                          file=sys.stderr)
                    refused.append(pid_id)
                    continue
                if proc is not None and proc.running:
                    proc.kill()
            gone.append(pid_id)
        forgotten = reg.forget(gone)
        _forget_files(forgotten, found, opened)
    for pid_id in forgotten:
        print(pid_id)
    if ids is None and not forgotten:
        print("nothing to prune", file=sys.stderr)
    return 1 if refused else 0
