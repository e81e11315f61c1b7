"""A memory cgroup per local command, for its peak memory.

``wait4`` cannot give a command's peak: a child starts with the high-water
mark of whatever it was forked from (the kernel keeps it across exec), so a
large calling process hides a small command. A memory cgroup the command
joins before it starts anything counts only what the command's tree charges
from then on: ``memory.peak`` (cgroup v2, Linux 5.19+) or
``memory.max_usage_in_bytes`` (v1). Both count anonymous memory and the page
cache the command brought in, as the OOM killer does. Made where we may
(root, or a delegated hierarchy); otherwise nothing is measured this way.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import uuid

__all__ = ["MemoryCgroup"]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"hermes-env-(\d+)-[0-9a-f]{8}")


@functools.lru_cache(maxsize=1)
def _parent() -> tuple[str, str] | None:
    """(directory new memory cgroups go in, the file that reports their peak), or None."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1: a hierarchy of its own
            base = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
            if _writable(base):
                _sweep_dead(base)
                return base, "memory.max_usage_in_bytes"
    return None  # a v2 pool with memory.peak is the tree cgroup's business


def _sweep_dead(base: str) -> None:
    """Remove the empty memory cgroups of hermes-env processes that are gone (killed before they could).

    A cgroup that still holds a process is busy and stays (rmdir refuses it).
    """
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        m = _NAME_RE.fullmatch(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        try:
            os.rmdir(os.path.join(base, name))
        except OSError:
            continue


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writable(directory: str) -> bool:
    probe = os.path.join(directory, f"hermes-env-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        os.rmdir(probe)
    except OSError:
        pass
    return True


class MemoryCgroup:
    """One command's memory cgroup: it writes 0 to ``procs`` to join; ``peak()`` at the end."""

    def __init__(self, path: str, peak_file: str) -> None:
        os.mkdir(path, 0o755)
        self.path = path
        self.procs = os.path.join(path, "cgroup.procs")
        self._peak_file = os.path.join(path, peak_file)

    @classmethod
    def make(cls) -> MemoryCgroup | None:
        parent = _parent()
        if parent is None:
            return None
        try:
            return cls(os.path.join(parent[0], f"hermes-env-{os.getpid()}-{uuid.uuid4().hex[:8]}"), parent[1])
        except OSError as exc:
            log.debug("no memory cgroup for a local command: %s", exc)
            return None

    def peak(self) -> int | None:
        try:
            with open(self._peak_file, encoding="ascii") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def reset_peak(self) -> None:
        """Start counting the peak afresh (the session server's cgroup, before each command)."""
        try:
            with open(self._peak_file, "w", encoding="ascii") as f:
                f.write("0")
        except OSError:
            pass

    def oom_kills(self) -> int | None:
        """How many of its processes the OOM killer ended (v1 ``memory.oom_control``)."""
        try:
            with open(os.path.join(self.path, "memory.oom_control"), encoding="ascii") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            return None
        return None

    def release(self) -> None:
        """Remove it; processes still in it (left behind in the background) go back to its parent."""
        parent_procs = os.path.join(os.path.dirname(self.path), "cgroup.procs")
        for _ in range(3):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                try:
                    with open(self.procs, encoding="ascii") as f:
                        pids = f.read().split()
                    for pid in pids:
                        with open(parent_procs, "w", encoding="ascii") as out:
                            out.write(pid)
                except OSError:
                    return
