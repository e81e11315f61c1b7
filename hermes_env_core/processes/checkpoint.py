"""The checkpoint file: which background processes are alive, so a new registry can take them back.

Written atomically (temporary file, fsync, rename) under an advisory lock, and
merged: entries another registry wrote, and this one never touched, are kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["Checkpoint", "default_checkpoint_path"]

VERSION = 1


def default_checkpoint_path() -> Path:
    """``$HERMES_ENV_PROCESSES_FILE``, else ``$XDG_STATE_HOME/hermes-env/processes.json``."""
    explicit = os.environ.get("HERMES_ENV_PROCESSES_FILE")
    if explicit:
        return Path(explicit).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "hermes-env" / "processes.json"


class Checkpoint:
    """A JSON file ``{"version": 1, "live": [...], "finished": [...]}`` of process records."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(str(self.path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read(self) -> dict[str, list[dict[str, Any]]]:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {"live": [], "finished": []}
        try:
            data = json.loads(raw)
        except ValueError:
            # Never half-written (rename is atomic): only a foreign file looks like this.
            return {"live": [], "finished": []}
        if not isinstance(data, dict) or data.get("version") != VERSION:
            return {"live": [], "finished": []}
        return {
            "live": [r for r in data.get("live", []) if isinstance(r, dict) and "id" in r],
            "finished": [r for r in data.get("finished", []) if isinstance(r, dict) and "id" in r],
        }

    def load(self) -> dict[str, list[dict[str, Any]]]:
        with self._locked():
            return self._read()

    def update(
        self,
        *,
        owned: Iterable[str],
        live: Iterable[dict[str, Any]],
        finished: Iterable[dict[str, Any]],
        keep_finished: int,
        keep_finished_s: float | None = None,
    ) -> None:
        """Replace the records whose ids are in ``owned`` by ``live`` and ``finished``; keep the others."""
        owned_ids = set(owned)
        live = list(live)
        finished = list(finished)
        owned_ids.update(r["id"] for r in live)
        owned_ids.update(r["id"] for r in finished)
        with self._locked():
            current = self._read()
            new_live = [r for r in current["live"] if r["id"] not in owned_ids] + live
            new_fin = [r for r in current["finished"] if r["id"] not in owned_ids] + finished
            if keep_finished_s is not None:
                cutoff = time.time() - keep_finished_s
                new_fin = [r for r in new_fin if (r.get("ended_at") or 0) >= cutoff]
            new_fin.sort(key=lambda r: r.get("ended_at") or 0)
            if keep_finished >= 0:
                new_fin = new_fin[len(new_fin) - keep_finished :] if keep_finished else []
            self._write({"version": VERSION, "live": new_live, "finished": new_fin})

    def _write(self, data: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".processes-", suffix=".tmp", dir=str(self.path.parent))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):
            dfd = os.open(str(self.path.parent), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
