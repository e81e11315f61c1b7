"""Pull-backs that failed, kept on disk: the engine's records for the mapping and why,
so that a later engine (the next CLI call, another process) refuses to push over them.

One small JSON file per (target, mapping) in a private per-user directory;
it exists only while the target may hold changes the host has not got.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .mapping import MappingState

__all__ = ["JOURNAL_ENV", "PendingPull", "SyncJournal", "default_journal_dir"]

#: Where the records of failed pulls live (a directory); default below $XDG_STATE_HOME.
JOURNAL_ENV = "HERMES_ENV_SYNC_JOURNAL"
_VERSION = 1


def default_journal_dir() -> Path:
    """``$HERMES_ENV_SYNC_JOURNAL``, else ``$XDG_STATE_HOME/hermes-env/sync-pending``."""
    explicit = os.environ.get(JOURNAL_ENV)
    if explicit:
        return Path(explicit).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "hermes-env" / "sync-pending"


@dataclass(frozen=True)
class PendingPull:
    """The target may hold changes to ``remote`` that never reached ``host``."""

    target: str
    host: str
    remote: str
    since: float  # time.time() of the failed pull
    reason: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"{self.host} <- {self.target}:{self.remote} (pull-back failed {when}: {self.reason})"


class SyncJournal:
    """Failed pulls of one target (``target`` names it: ``ssh:user@host``)."""

    def __init__(self, target: str, directory: str | os.PathLike[str] | None = None) -> None:
        self.target = target
        self.directory = Path(directory) if directory is not None else default_journal_dir()

    def _path(self, state: MappingState) -> Path:
        key = "\0".join((self.target, state.host_root, state.anchor, state.remote_rel))
        return self.directory / f"{hashlib.sha256(key.encode('utf-8', 'surrogateescape')).hexdigest()[:40]}.json"

    def record(self, state: MappingState, reason: str) -> PendingPull:
        """Write what the engine knew of ``state`` and why its pull failed (kept until a pull succeeds)."""
        pending = PendingPull(self.target, state.host_root, state.remote_path, time.time(), reason)
        data = {
            "version": _VERSION,
            "target": pending.target,
            "host": pending.host,
            "remote": pending.remote,
            "since": pending.since,
            "reason": pending.reason,
            "stats": {rel: list(st) for rel, st in state.stats.items()},
            "hashes": {rel: h.hex() for rel, h in state.hashes.items()},
            "doubt": sorted(state.doubt),
        }
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self._path(state)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".pending-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return pending

    def load(self, state: MappingState) -> PendingPull | None:
        """Restore the records of an earlier failed pull into ``state``; None when there is none."""
        path = self._path(state)
        try:
            data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            # Unreadable: still a pull that failed. Keep the refusal, without records.
            return PendingPull(self.target, state.host_root, state.remote_path, time.time(),
                               f"its record {path} cannot be read ({exc})")
        if data.get("version") != _VERSION:
            return PendingPull(self.target, state.host_root, state.remote_path, float(data.get("since", 0.0)),
                               f"its record {path} is of another version")
        state.stats.update({rel: (int(a), int(b), int(c)) for rel, (a, b, c) in data.get("stats", {}).items()})
        state.hashes.update({rel: bytes.fromhex(h) for rel, h in data.get("hashes", {}).items()})
        state.doubt.update(data.get("doubt", ()))
        return PendingPull(self.target, str(data.get("host", state.host_root)), str(data.get("remote", state.remote_path)),
                           float(data.get("since", 0.0)), str(data.get("reason", "")))

    def clear(self, state: MappingState) -> None:
        with contextlib.suppress(OSError):
            self._path(state).unlink()

