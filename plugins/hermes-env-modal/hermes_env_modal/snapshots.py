"""Where persistent environments remember their filesystem snapshots: image ids by task id.

A small JSON file, rewritten atomically (temp file, fsync, rename) under an
advisory lock, so concurrent processes never leave it torn or lose an entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SnapshotRecord", "SnapshotStore"]

_VERSION = 1


@dataclass(frozen=True)
class SnapshotRecord:
    """One task's latest snapshot."""

    key: str
    image_id: str
    saved_at: float
    sandbox_id: str | None = None
    base_image: str | None = None
    #: when the service deletes the image (``snapshot_filesystem``'s ttl), None: never
    expires_at: float | None = None

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at


class SnapshotStore:
    """Image ids by key (``"<mode>:<task id>"``) in the JSON file at ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()

    def get(self, key: str) -> SnapshotRecord | None:
        entry = self._read().get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("image_id"), str):
            return None
        return SnapshotRecord(
            key=key,
            image_id=entry["image_id"],
            saved_at=float(entry.get("saved_at", 0.0)),
            sandbox_id=entry.get("sandbox_id"),
            base_image=entry.get("base_image"),
            expires_at=float(entry["expires_at"]) if isinstance(entry.get("expires_at"), (int, float)) else None,
        )

    def put(
        self,
        key: str,
        image_id: str,
        *,
        sandbox_id: str | None = None,
        base_image: str | None = None,
        ttl: float | None = None,
    ) -> None:
        now = time.time()
        entry = {
            "image_id": image_id,
            "saved_at": now,
            "sandbox_id": sandbox_id,
            "base_image": base_image,
            "expires_at": None if ttl is None else now + ttl,
        }
        with self._locked():
            data = self._read()
            data[key] = entry
            self._write(data)

    def remove(self, key: str) -> None:
        with self._locked():
            data = self._read()
            if data.pop(key, None) is not None:
                self._write(data)

    # -- internals ---------------------------------------------------------------
    def _read(self) -> dict[str, object]:
        try:
            with open(self.path, encoding="utf-8") as fh:
                raw = json.load(fh)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            # An unreadable store only loses the chance to restore; it must not
            # stop the environment from starting.
            return {}
        snaps = raw.get("snapshots") if isinstance(raw, dict) else None
        return dict(snaps) if isinstance(snaps, dict) else {}

    def _write(self, snapshots: dict[str, object]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": _VERSION, "snapshots": snapshots}, fh, indent=1, sort_keys=True)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
