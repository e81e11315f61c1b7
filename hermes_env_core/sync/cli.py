"""``hermes-env pull``: bring the target's changes to the synced host paths back now.

Also what lifts a refused push after a pull-back failed (``SyncConflictError``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..errors import UsageError

__all__ = ["add_subcommands", "cmd_pull"]

EnvironmentOpener = Callable[[argparse.Namespace], AbstractContextManager[Any]]


def add_subcommands(
    subparsers: argparse._SubParsersAction,  # type: ignore[type-arg]
    *,
    parents: Sequence[argparse.ArgumentParser] = (),
    environment: EnvironmentOpener,
) -> None:
    """Add ``pull``; ``environment(args)`` opens the environment that ``--env``/``-o`` name."""
    p = subparsers.add_parser(
        "pull", parents=list(parents), help="bring the target's changes to synced files back now",
        description="Apply the changes the target made to the paths of its `sync` mappings to this machine, as "
        "the pull-back at close does: a file changed on both sides is taken from the target and the host "
        "version kept beside it as NAME.hermes-conflict-STAMP. Run it when a push was refused because an "
        "earlier pull-back failed. Exit status 1 if there were conflicts or skipped entries.",
    )
    p.set_defaults(func=lambda a: cmd_pull(a, environment))


def cmd_pull(args: argparse.Namespace, environment: EnvironmentOpener) -> int:
    with environment(args) as env:
        pull = getattr(env, "pull_files", None)
        if pull is None:
            raise UsageError(f"pull: backend {env.name!r} does not sync files")
        result = pull()
        if result is None:
            raise UsageError(f"pull: no sync mappings are configured for backend {env.name!r} (option `sync`)")
    for path in result.created:
        print(f"created  {path}")
    for path in result.updated:
        print(f"updated  {path}")
    for path in result.deleted:
        print(f"deleted  {path}")
    for c in result.conflicts:
        print(f"conflict {c.path}: {c.reason}" + (f" (host version: {c.backup})" if c.backup else ""))
    for note in result.notes:
        print(f"hermes-env: {note}", file=sys.stderr)
    if not (result.changed or result.conflicts):
        print("nothing to pull")
    return 1 if result.conflicts or result.skipped or result.refused else 0
