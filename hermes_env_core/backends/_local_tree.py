"""Finding and stopping every process a local command started.

A cgroup v2 per command where one can be made (nothing leaves it, whether it
calls setsid or not); always also the process tree and group seen through psutil.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import logging
import os
import re
import signal
import threading
import time

import psutil

__all__ = ["CommandCgroup", "ProcessTree", "cgroup_pool", "stop_all", "wait_dead"]

log = logging.getLogger(__name__)

_counter = itertools.count()
_pool_lock = threading.Lock()
_pool: tuple[str, str] | None | bool = False  # False: not looked for yet
_stale: set[str] = set()  # command cgroups whose removal failed (a process raced in): tried again later


def _own_cgroup() -> str | None:
    """This process's cgroup v2 directory, when the unified hierarchy is mounted."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rel = next((line[3:] for line in lines if line.startswith("0::")), None)
    if rel is None or rel.endswith("(deleted)"):
        return None
    try:
        mounts = [p.mountpoint for p in psutil.disk_partitions(all=True) if p.fstype == "cgroup2"]
    except Exception:  # noqa: BLE001 - no mount table: no cgroup
        return None
    for mount in mounts:
        path = os.path.join(mount, rel.lstrip("/"))
        if os.path.isfile(os.path.join(path, "cgroup.procs")):
            return path
    return None


def cgroup_pool() -> tuple[str, str] | None:
    """(our own cgroup, a directory we may create command cgroups in), or None.

    Made once per process, removed at exit. None when there is no cgroup v2,
    it cannot be written (an unprivileged user outside a delegated subtree,
    a read-only mount in a container), or it lacks ``cgroup.kill``.
    """
    global _pool
    with _pool_lock:
        if _pool is False:
            _pool = _make_pool()
        return _pool if _pool else None  # type: ignore[return-value]


def _make_pool() -> tuple[str, str] | None:
    own = _own_cgroup()
    if own is None:
        return None
    _sweep_dead_pools(own)
    pool = os.path.join(own, f"hermes-env-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(pool)
    except OSError as exc:
        log.debug("no cgroup for local commands (%s): %s", own, exc)
        return None
    if not os.path.exists(os.path.join(pool, "cgroup.kill")) or not os.access(
        os.path.join(pool, "cgroup.procs"), os.W_OK
    ):
        _rmdir(pool)
        return None
    atexit.register(_remove_pool, pool)
    return own, pool


def _sweep_dead_pools(own: str) -> None:
    """Remove the empty cgroups a killed process of ours left (rmdir refuses busy ones)."""
    try:
        names = os.listdir(own)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(r"hermes-env-(\d+)-[0-9a-f]{8}", name)
        if m is None or psutil.pid_exists(int(m.group(1))):
            continue
        path = os.path.join(own, name)
        try:
            kids = [e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for kid in kids:
            _rmdir(kid)
        _rmdir(path)


def _sweep_stale() -> None:
    for path in list(_stale):
        if _rmdir(path):
            _stale.discard(path)


def _remove_pool(pool: str) -> None:
    _sweep_stale()
    _rmdir(pool)


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


class CommandCgroup:
    """The cgroup one command runs in; ``procs`` is where the command adds itself."""

    def __init__(self, own: str, pool: str) -> None:
        if _stale:
            _sweep_stale()
        self.own = own
        self.path = os.path.join(pool, f"c{next(_counter)}")
        os.mkdir(self.path)
        self.procs = os.path.join(self.path, "cgroup.procs")

    def pids(self) -> list[int]:
        try:
            with open(self.procs, encoding="ascii") as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def populated(self) -> bool:
        try:
            with open(os.path.join(self.path, "cgroup.events"), encoding="ascii") as f:
                return "populated 1" in f.read()
        except OSError:
            return False

    def _write(self, name: str, value: str) -> bool:
        try:
            with open(os.path.join(self.path, name), "w", encoding="ascii") as f:
                f.write(value)
            return True
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.debug("cgroup %s: writing %s failed: %s", self.path, name, exc)
            return False

    def signal(self, sig: int) -> None:
        if sig == signal.SIGKILL and self._write("cgroup.kill", "1"):
            return
        # Frozen, nobody forks between the listing and the signal; a frozen
        # process receives the signal when thawed.
        frozen = self._write("cgroup.freeze", "1")
        try:
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        finally:
            if frozen:
                self._write("cgroup.freeze", "0")

    def release(self, *, keep_alive: bool) -> bool:
        """Remove the cgroup. Processes still in it are moved back to ours
        (``keep_alive``: background jobs a command left running) or killed.
        True once it is gone."""
        for _ in range(20):
            pids = self.pids()
            if not pids:
                break
            if keep_alive:
                for pid in pids:
                    try:
                        with open(os.path.join(self.own, "cgroup.procs"), "w", encoding="ascii") as f:
                            f.write(str(pid))
                    except OSError:
                        pass
            else:
                self.signal(signal.SIGKILL)
                _wait_gone(pids, 2.0)
        if _rmdir(self.path):
            return True
        _stale.add(self.path)
        return False


class ProcessTree:
    """A command's processes as psutil sees them: its bash, the descendants
    found from it so far, and its process group. Each ``refresh`` adds what it
    finds and forgets nothing, so a child seen before its parent exited is
    still signalled after it has been re-parented."""

    def __init__(self, root_pid: int, *, reaped: bool = False) -> None:
        """``reaped``: the root was already waited for, so its id may name another process now."""
        self.root_pid = root_pid
        self.seen: dict[int, psutil.Process] = {}
        if not reaped:
            try:
                self.seen[root_pid] = psutil.Process(root_pid)
            except psutil.Error:
                pass

    def _group_is_ours(self) -> bool:
        """Whether ``root_pid`` still names the root's process group. While our root lives
        (a zombie too) it holds the id; once it is gone, a group member left holds the id, so
        no new process can have it: a live process with that id means it was given out again."""
        root = self.seen.get(self.root_pid)
        if root is not None:
            try:
                if root.is_running():  # the same process (pid and start time)
                    return True
            except psutil.Error:
                pass
        return not psutil.pid_exists(self.root_pid)

    def refresh(self) -> None:
        for proc in list(self.seen.values()):
            try:
                kids = proc.children(recursive=True)
            except psutil.Error:
                continue
            for kid in kids:
                self.seen.setdefault(kid.pid, kid)
        # The group holds children whose parent already exited.
        for proc in psutil.process_iter() if self._group_is_ours() else ():
            if proc.pid in self.seen:
                continue
            try:
                if os.getpgid(proc.pid) == self.root_pid:
                    self.seen[proc.pid] = proc
            except OSError:
                continue
        for proc in list(self.seen.values()):
            try:
                kids = proc.children(recursive=True)
            except psutil.Error:
                continue
            for kid in kids:
                self.seen.setdefault(kid.pid, kid)

    def alive(self) -> list[psutil.Process]:
        return [proc for proc in self.seen.values() if _live(proc)]

    def stop(self, sig: int) -> None:
        """Look again, then send ``sig`` to the tree and to the group."""
        self.refresh()
        self.signal(sig)
        if self._group_is_ours():
            try:
                os.killpg(self.root_pid, sig)
            except OSError:
                pass

    def signal(self, sig: int) -> None:
        procs = self.alive()
        # Stopped first, so that none forks or exits between the signals.
        for action in (signal.SIGSTOP, sig, signal.SIGCONT):
            for proc in procs:
                try:
                    proc.send_signal(action)  # checks the pid still names the same process
                except psutil.Error:
                    pass


def _live(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_dead(procs: list[psutil.Process], timeout: float) -> bool:
    """Wait until each of ``procs`` has exited (a zombie counts: it runs no
    more, and only its parent can reap it). True when all have."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        procs = [p for p in procs if _live(p)]
        if not procs:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        # psutil.wait_procs would wait for a zombie to be reaped by its parent.
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.05)


def _wait_gone(pids: list[int], timeout: float) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    wait_dead(procs, timeout)


def stop_all(cgroup: CommandCgroup | None, tree: ProcessTree, sig: int) -> None:
    """Send ``sig`` to every process of the command that can be found."""
    tree.refresh()
    if cgroup is not None:
        cgroup.signal(sig)
    tree.stop(sig)
