"""Facts about processes on this machine, read from /proc, and a tree kill.

A pid alone names nothing once its process is gone; a pid plus the start time
from ``/proc/<pid>/stat`` names one process for the life of the machine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

__all__ = ["ProcStat", "is_alive", "kill_tree", "open_pidfd", "proc_stat", "start_time", "tree"]


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    pgid: int
    sid: int
    start_time: int  # clock ticks since boot (field 22)


def proc_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    """The parsed ``/proc/<pid>/stat``, or None when there is no such process."""
    try:
        with open(f"{proc}/{int(pid)}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return ProcStat(int(pid), rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    st = proc_stat(pid)
    return None if st is None else st.start_time


def is_alive(pid: int, started: int | None = None) -> bool:
    """True while ``pid`` runs (zombies count as gone) and, if given, started at ``started``."""
    st = proc_stat(pid)
    if st is None or st.state in ("Z", "X"):
        return False
    return started is None or st.start_time == started


def _table() -> list[ProcStat]:
    out: list[ProcStat] = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                out.append(st)
    return out


def tree(root: int, pgid: int | None = None) -> list[ProcStat]:
    """``root`` and its descendants, plus the members of process group ``pgid``."""
    table = _table()
    kids: dict[int, list[ProcStat]] = {}
    by_pid: dict[int, ProcStat] = {}
    for st in table:
        kids.setdefault(st.ppid, []).append(st)
        by_pid[st.pid] = st
    found: dict[int, ProcStat] = {}
    todo = [by_pid[root]] if root in by_pid else []
    if pgid is not None and pgid > 1:
        todo += [st for st in table if st.pgid == pgid]
    while todo:
        st = todo.pop()
        if st.pid in found or st.pid == os.getpid():
            continue
        found[st.pid] = st
        todo.extend(kids.get(st.pid, ()))
    return list(found.values())


def _signal_all(members: list[ProcStat], sig: int) -> None:
    for st in members:
        try:
            os.kill(st.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(
    root: int,
    *,
    pgid: int | None,
    grace: float,
    root_started: int | None = None,
    root_gone: threading.Event | None = None,
) -> None:
    """End ``root``'s tree: SIGTERM, then SIGKILL for whatever is left after ``grace`` seconds.

    The tree is frozen (SIGSTOP) while it is signalled, so nothing forks away
    between the walk and the signal; survivors are matched by start time, so a
    pid reused meanwhile is never hit. ``root_started`` guards the root itself.
    """
    if root_started is not None and not is_alive(root, root_started) and pgid is None:
        return
    members = tree(root, pgid)
    if root_started is not None:
        members = [m for m in members if m.pid != root or m.start_time == root_started]
    if not members:
        return
    _signal_all(members, signal.SIGSTOP)
    _signal_all(members, signal.SIGTERM)
    _signal_all(members, signal.SIGCONT)
    deadline = time.monotonic() + grace
    pending = members
    while pending:
        pending = [m for m in pending if is_alive(m.pid, m.start_time)]
        if not pending or time.monotonic() >= deadline:
            break
        if root_gone is not None and any(m.pid == root for m in pending):
            root_gone.wait(min(0.01, max(deadline - time.monotonic(), 0)))
        else:
            time.sleep(0.005)  # polling /proc for strangers' exits; there is no event to wait on
    if pending:
        # Children started during the grace period join the last round.
        late = [m for m in tree(root, pgid) if m.pid not in {p.pid for p in members}]
        # Frozen first: a parent must not see a child die and exit by itself
        # (status 0) between two kills.
        _signal_all(pending + late, signal.SIGSTOP)
        _signal_all(pending + late, signal.SIGKILL)


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once it exits), or None where unsupported."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None
