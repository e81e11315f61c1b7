"""Is a program on a pseudo-terminal blocked reading its terminal?

Silence alone says nothing (a long computation is silent too); the kernel
says what a process is blocked in. ``/proc/<pid>/syscall`` gives the system
call a sleeping process sits in and its arguments, and ``/proc/<pid>/fd``
says what its descriptors are: a process in the terminal's foreground group
that sleeps in ``read`` of the terminal, or in ``select``/``poll`` on it
alone (readline's wait), wants its user.
"""

from __future__ import annotations

import os
import platform

import psutil

__all__ = ["reading_terminal", "tty_of", "waiting_in_group"]

# System call numbers differ per architecture (arch/*/entry/syscalls tables).
_CALLS: dict[str, dict[str, frozenset[int]]] = {
    "x86_64": {
        "read": frozenset({0, 17, 19}),  # read, pread64, readv
        "select": frozenset({23, 270}),  # select, pselect6: arg 0 is nfds
        "poll": frozenset({7, 271}),  # poll, ppoll: arg 1 is nfds
    },
    "aarch64": {
        "read": frozenset({63, 65, 67}),
        "select": frozenset({72}),
        "poll": frozenset({73}),
    },
}
_TABLE = _CALLS.get(platform.machine())


def tty_of(pid: int, fd: int = 0) -> str | None:
    """The terminal device behind ``fd`` of ``pid`` (``/dev/pts/N``), if it is one."""
    try:
        path = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return path if path.startswith("/dev/pts/") or path.startswith("/dev/tty") else None


def reading_terminal(pid: int, tty: str) -> bool:
    """True when ``pid`` sleeps in a read of ``tty`` (or waits for it alone)."""
    if _TABLE is None:
        return False
    try:
        with open(f"/proc/{pid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    if len(fields) < 3 or not fields[0].isdigit():
        return False  # "running", or a process we may not inspect
    nr = int(fields[0])
    args = [int(a, 16) for a in fields[1:4]]
    if nr in _TABLE["read"]:
        return _fd_is(pid, args[0], tty)
    if nr in _TABLE["select"]:
        fds = [fd for fd in range(min(args[0], 64)) if os.path.lexists(f"/proc/{pid}/fd/{fd}")]
        return bool(fds) and all(_fd_is(pid, fd, tty) for fd in fds)
    if nr in _TABLE["poll"]:
        # Which descriptors are polled is in the caller's memory; one polled
        # descriptor with the terminal as stdin is readline's wait for a key.
        return args[1] == 1 and _fd_is(pid, 0, tty)
    return False


def _fd_is(pid: int, fd: int, tty: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}") == tty
    except OSError:
        return False


def waiting_in_group(root: int, pgid: int, tty: str) -> bool:
    """True when a process of ``root``'s tree in group ``pgid`` reads ``tty`` and none of the group runs."""
    try:
        top = psutil.Process(root)
        members = [top, *top.children(recursive=True)]
    except psutil.Error:
        return False
    waiting = False
    for p in members:
        try:
            if os.getpgid(p.pid) != pgid:
                continue
            if p.status() == psutil.STATUS_RUNNING:
                return False
        except (psutil.Error, OSError):
            continue
        waiting = waiting or reading_terminal(p.pid, tty)
    return waiting
