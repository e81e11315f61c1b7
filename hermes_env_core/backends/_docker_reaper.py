"""Labels on our containers, who owns them, and the reaper that removes orphans.

A container is an orphan when its owner process (same host) is gone: a
non-persistent one is removed at once, a persistent one when it has exited or
has been idle longer than the lifetime recorded in its labels.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
import time
from typing import Any

__all__ = [
    "IN_USE",
    "LABEL_TASK",
    "container_name",
    "labels_for",
    "owner_alive",
    "reap_once",
    "reap_orphans",
]

LABEL_PREFIX = "hermes-env."
LABEL_TASK = "hermes-env.task-id"
LABEL_OWNER_PID = "hermes-env.owner-pid"
LABEL_OWNER_START = "hermes-env.owner-start"
LABEL_OWNER_HOST = "hermes-env.owner-host"
LABEL_CREATED = "hermes-env.created"
LABEL_PERSISTENT = "hermes-env.persistent"
LABEL_IDLE = "hermes-env.idle-lifetime-s"
LABEL_CONFIG = "hermes-env.config"

#: Names of containers an environment of this process is using; never reaped.
IN_USE: set[str] = set()
_IN_USE_LOCK = threading.Lock()

# A command's wrapper rewrites its state file in /tmp every time, so the
# newest mtime there is the last use (an exec that prints epoch seconds); a
# background process that still runs (a pid file, no exit file, its pid
# alive) makes the container in use now, however quiet it is.
_LAST_USE_CMD = [
    "sh",
    "-c",
    "for f in /tmp/hermes-env-bg-*/*/pid; do [ -f \"$f\" ] || continue; d=${f%/pid}; "
    "[ -s \"$d/exit\" ] && continue; read -r p _ <\"$f\" && [ -d \"/proc/$p\" ] && date +%s; done; "
    "stat -c %Y /tmp/.hermes-*.state 2>/dev/null || true",
]

_reaped: set[str] = set()
_reaped_lock = threading.Lock()


def _proc_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (None when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _hostname() -> str:
    return socket.gethostname()


def labels_for(task_id: str, *, persistent: bool, idle_lifetime_s: float, config_hash: str) -> dict[str, str]:
    pid = os.getpid()
    return {
        LABEL_TASK: task_id,
        LABEL_OWNER_PID: str(pid),
        LABEL_OWNER_START: _proc_start(pid) or "",
        LABEL_OWNER_HOST: _hostname(),
        LABEL_CREATED: str(int(time.time())),
        LABEL_PERSISTENT: "1" if persistent else "0",
        LABEL_IDLE: f"{idle_lifetime_s:g}",
        LABEL_CONFIG: config_hash,
    }


def container_name(task_id: str, *, persistent: bool) -> str:
    """A valid container name for ``task_id``; persistent names are stable."""
    slug = re.sub(r"[^a-zA-Z0-9_.-]+", "-", task_id).strip("-.")[:40] or "task"
    if slug != task_id:
        slug += "-" + hashlib.sha256(task_id.encode()).hexdigest()[:8]
    name = f"hermes-env-{slug}"
    return name if persistent else f"{name}-{os.urandom(3).hex()}"


def owner_alive(labels: dict[str, str]) -> bool:
    """Whether the process that created the container still runs (on this host)."""
    try:
        pid = int(labels.get(LABEL_OWNER_PID, ""))
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    start = labels.get(LABEL_OWNER_START)
    now_start = _proc_start(pid)
    return not (start and now_start and start != now_start)  # pid reused


def mark_in_use(name: str, used: bool) -> None:
    with _IN_USE_LOCK:
        (IN_USE.add if used else IN_USE.discard)(name)


def _last_use(api: Any, c: dict[str, Any]) -> float | None:
    """Epoch of the container's last command, read inside it; None if unknown."""
    try:
        ex = api.exec_create(c["Id"], _LAST_USE_CMD)
        out = api.exec_start(ex["Id"])
    except Exception:  # noqa: BLE001 - an unreadable container is left alone
        return None
    times = [int(w) for w in out.decode("ascii", "replace").split() if w.isdigit()]
    created = float(c.get("Labels", {}).get(LABEL_CREATED) or c.get("Created") or 0)
    return max(times + [created]) if (times or created) else None


def reap_orphans(api: Any, *, now: float | None = None) -> list[str]:
    """Remove our orphaned containers on this engine; returns the names removed."""
    now = time.time() if now is None else now
    host = _hostname()
    removed: list[str] = []
    for c in api.containers(all=True, filters={"label": LABEL_TASK}):
        labels = c.get("Labels") or {}
        name = (c.get("Names") or ["/" + c["Id"][:12]])[0].lstrip("/")
        if labels.get(LABEL_OWNER_HOST) != host or name in IN_USE or owner_alive(labels):
            continue
        state = c.get("State", "")
        if state == "running" and labels.get(LABEL_PERSISTENT) == "1":
            try:
                lifetime = float(labels.get(LABEL_IDLE, "inf"))
            except ValueError:
                continue
            last = _last_use(api, c)
            if last is None or now - last <= lifetime:
                continue
        elif state in ("removing", "paused", "restarting"):
            continue
        try:
            api.remove_container(c["Id"], force=True, v=True)
            removed.append(name)
        except Exception:  # noqa: BLE001 - gone already, or another reaper got it
            pass
    return removed


def reap_once(api: Any, engine_key: str) -> threading.Thread | None:
    """Start the reaper in a daemon thread, once per process and engine."""
    with _reaped_lock:
        if engine_key in _reaped:
            return None
        _reaped.add(engine_key)

    def run() -> None:
        try:
            reap_orphans(api)
        except Exception:  # noqa: BLE001 - best effort; the next process tries again
            pass

    t = threading.Thread(target=run, name="hermes-docker-reaper", daemon=True)
    t.start()
    return t
