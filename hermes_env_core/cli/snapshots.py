"""``hermes-env snapshots``: list stored snapshots; ``snapshots rm NAME`` deletes one."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..environment.snapshot import list_snapshots, remove_snapshot, snapshots_dir
from .common import add_command

__all__ = ["add_commands", "cmd_snapshots"]


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = add_command(
        sub,
        "snapshots",
        "list snapshots; 'snapshots rm NAME' deletes one",
        "List the stored snapshots (env.snapshot() in Python) with backend, age, what holds their files and "
        "their size; a snapshot whose parts do not match its manifest is shown as refused, with why. "
        "'snapshots rm NAME...' deletes snapshots (a docker snapshot's image too). "
        "They live in $XDG_STATE_HOME/hermes-env/snapshots.",
    )
    p.add_argument("action", nargs="?", choices=["ls", "rm"], default="ls", help="ls (default) or rm")
    p.add_argument("names", nargs="*", metavar="NAME", help="snapshots to delete (rm)")
    p.add_argument("--json", action="store_true", help="machine-readable output (ls)")
    p.set_defaults(func=cmd_snapshots)


def _age(created: float) -> str:
    s = max(time.time() - created, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def cmd_snapshots(args: argparse.Namespace) -> int:
    if args.action == "rm":
        if not args.names:
            print("hermes-env: error: snapshots rm needs at least one NAME", file=sys.stderr)
            return 2
        for name in args.names:
            remove_snapshot(name)
            print(f"removed snapshot {name}")
        return 0
    if args.names:
        print("hermes-env: error: snapshots ls takes no NAME", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for name, snap, problem in list_snapshots():
        if snap is None:
            rows.append({"name": name, "refused": problem})
            continue
        files = snap.files
        where = {"image": files.ref, "archive": ", ".join(files.roots), "none": "(state only)"}.get(files.kind, "")
        rows.append({
            "name": name, "backend": snap.backend, "created": snap.created, "files": files.kind,
            "from": where, "size": files.size, "omitted": list(snap.omitted),
        })
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no snapshots (in {snapshots_dir(create=False)})")
        return 0
    print(f"{'NAME':<28} {'BACKEND':<8} {'AGE':>5} {'FILES':<8} {'SIZE':>10}  FROM")
    for r in rows:
        if "refused" in r:
            print(f"{r['name']:<28} REFUSED: {r['refused']}")
        else:
            print(f"{r['name']:<28} {r['backend']:<8} {_age(r['created']):>5} {r['files']:<8} {r['size']:>10}  {r['from']}")
    return 0
