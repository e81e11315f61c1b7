"""Pull-back: the target's tree comes home as one archive per mapping, and only
what the target changed since the push is applied to the host.

Rules, per path (``pushed`` = what the last push recorded):

* remote content equals ``pushed``: nothing happens (host edits are pushed later);
* remote changed, host unchanged since the push: the remote version is written;
* remote changed and host changed too: the remote version is written and the
  host version kept beside it as ``<name>.hermes-conflict-<UTC stamp>``;
  reported as a conflict (no conflict when both sides hold the same bytes);
* remote changed, host deleted since the push: the remote version is restored
  (reported);
* deleted in the target, host unchanged since the push: deleted on the host;
* deleted in the target, host changed since the push: the host file stays and
  is pushed again next time (reported);
* a remote root that does not exist (target wiped or never pushed) deletes
  nothing: it is reported in ``missing``;
* an entry that cannot be applied safely (a symlink whose target leaves the
  tree, a fifo, a device) is skipped and reported in ``skipped``; the host
  keeps what it has there, and every other change is applied;
* an archive whose member names leave the mapping (``../``, absolute names, a
  member under a symlink, a hard link to outside) is tampering: the whole pull
  is refused, nothing is written, and ``UnsafeArchiveError`` carries the
  report (``refused``).

Every write goes to a temporary name then ``rename``; Ctrl-C is deferred while
the writes run, and a refused archive leaves the host untouched.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import secrets
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import SyncError, UnsafeArchiveError
from .archive import (
    RemoteEntry,
    RemoteTree,
    check_symlink,
    file_digest,
    link_digest,
    read_archive,
)
from .filters import Stat
from .guard import TreeLock, defer_sigint
from .mapping import MappingState

if TYPE_CHECKING:
    from .engine import ProgressCallback, SyncEngine

__all__ = ["CONFLICT_MARKER", "PullResult", "SyncConflict"]

CONFLICT_MARKER = ".hermes-conflict-"
_S_IFMT = 0o170000
_S_IFLNK = 0o120000


@dataclass(frozen=True)
class SyncConflict:
    """A path changed on both sides. ``backup`` holds the host version when the
    remote one replaced it; None when the host version was kept in place."""

    path: str
    reason: str
    backup: str | None = None


@dataclass(frozen=True)
class PullResult:
    """What one ``pull()`` changed on the host (host paths)."""

    created: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    conflicts: tuple[SyncConflict, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()  # (host path, why)
    missing: tuple[str, ...] = ()  # remote roots that did not exist
    bytes_received: int = 0
    refused: tuple[tuple[str, str], ...] = ()  # (remote root, why): archive refused whole, nothing applied

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted)

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per thing the caller should hear about: skips and refusals."""
        out = [f"pull-back refused the archive of {root}: {why}; nothing was applied" for root, why in self.refused]
        out += [f"pull-back skipped {path}: {why}" for path, why in self.skipped]
        return tuple(out)


@dataclass
class _Plan:
    state: MappingState
    tree: RemoteTree
    deletes: list[str] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    mkdirs: list[str] = field(default_factory=list)
    writes: list[tuple[str, RemoteEntry, str | None]] = field(default_factory=list)  # (rel, entry, conflict reason)
    records: list[tuple[str, Stat, bytes]] = field(default_factory=list)  # same bytes both sides


class _Outcome:
    def __init__(self) -> None:
        self.created: list[str] = []
        self.updated: list[str] = []
        self.deleted: list[str] = []
        self.conflicts: list[SyncConflict] = []
        self.skipped: list[tuple[str, str]] = []


def run_pull(engine: SyncEngine, report: ProgressCallback | None) -> PullResult:
    trees: list[tuple[MappingState, RemoteTree]] = []
    missing: list[str] = []
    received = 0
    current = ""
    try:
        for state in engine._maps:
            if state.mapping.upload_only:
                continue
            current = state.remote_path
            tree = engine._with_retry(f"downloading {state.remote_path!r}", functools.partial(_download, engine, state))
            if tree is None:
                missing.append(state.remote_path)
                continue
            assert isinstance(tree, RemoteTree)
            received += tree.total_bytes
            trees.append((state, tree))
        out = _Outcome()
        with contextlib.ExitStack() as locks:
            for path in sorted({s.lock_path() for s, _ in trees}):
                lock = TreeLock(path, lock_dir=engine.lock_dir, timeout=engine.lock_timeout,
                                on_wait=functools.partial(engine._trace, "lock-wait", path))
                locks.enter_context(lock)
            engine._trace("lock-acquired", "")
            plans = []
            for state, tree in trees:
                current = state.remote_path
                plans.append(_plan(state, tree, out))
            total = sum(len(p.deletes) + len(p.writes) for p in plans)
            with defer_sigint():
                engine._trace("apply-start", str(total))
                done = 0
                for plan in plans:
                    done = _apply(engine, plan, out, report, done, total)
                engine._trace("apply-done", str(done))
    except UnsafeArchiveError as exc:
        # Tampering: nothing was written. The caller still gets a report.
        exc.report = PullResult(missing=tuple(missing), bytes_received=received, refused=((current, str(exc)),))
        raise
    finally:
        for _, tree in trees:
            tree.close()
    return PullResult(
        created=tuple(out.created),
        updated=tuple(out.updated),
        deleted=tuple(out.deleted),
        conflicts=tuple(out.conflicts),
        skipped=tuple(out.skipped),
        missing=tuple(missing),
        bytes_received=received,
    )


def _download(engine: SyncEngine, state: MappingState) -> RemoteTree | None:
    root, sub = state.download_args()
    stream = engine.transport.download(root, sub, state.filter.hints())
    if stream is None:
        return None
    try:
        return read_archive(
            stream,
            accept=state.accepts,
            known=state.hashes.get,
            max_bytes=engine.max_archive_bytes,
            max_members=engine.max_members,
        )
    finally:
        stream.close()


def _host_digest(path: str, st: Stat) -> bytes | None:
    try:
        if st[2] & _S_IFMT == _S_IFLNK:
            return link_digest(os.readlink(path))
        return file_digest(path)
    except OSError:
        return None


def _plan(state: MappingState, tree: RemoteTree, out: _Outcome) -> _Plan:
    """Decide every action for one mapping, refusing unsafe ones before any write."""
    plan = _Plan(state, tree)
    host = state.scan()
    entries = tree.entries
    for rel in list(state.hashes):
        if rel in entries and entries[rel].kind != "dir":
            continue
        if rel in tree.unsafe:
            continue  # still there in the target, in a form not copied: the host keeps its version
        if rel in state.doubt or not state.accepts(rel):
            continue
        now = host.get(rel)
        if now is None:
            plan.forget.append(rel)
        elif now == state.stats.get(rel):
            plan.deletes.append(rel)
        else:
            plan.forget.append(rel)
            out.conflicts.append(SyncConflict(state.host_path(rel), "deleted in the target, changed on the host: kept the host version"))
    deleting = set(plan.deletes)
    for rel, why in sorted(tree.unsafe.items()):
        if state.accepts(rel):
            out.skipped.append((state.host_path(rel), why))
    for rel, entry in entries.items():
        path = state.host_path(rel)
        if entry.kind == "dir":
            if not os.path.lexists(path):
                plan.mkdirs.append(rel)
            continue
        if rel in state.doubt:
            out.skipped.append((path, "the last push of this file failed; the host version is kept"))
            continue
        if entry.digest == state.hashes.get(rel):
            continue
        now = host.get(rel)
        recorded = state.stats.get(rel)
        reason: str | None = None
        if now is not None and now != recorded:
            if _host_digest(path, now) == entry.digest:
                plan.records.append((rel, now, entry.digest))  # type: ignore[arg-type]
                continue
            reason = "changed on the host and in the target: took the target version, host version backed up"
        elif now is None and recorded is not None:
            reason = "deleted on the host, changed in the target: restored the target version"
        if entry.kind == "link":
            try:
                check_symlink(rel, entry.target, lambda p: _is_link(state, p, entries, deleting))
            except UnsafeArchiveError as exc:
                out.skipped.append((path, f"{exc}; not copied"))
                continue
        if entry.copy_of is not None and not _stage_copy(state, tree, entry, host):
            out.skipped.append((path, f"hard link to {entry.copy_of!r}, whose host copy changed; pull again later"))
            continue
        _check_parents(state, rel, deleting)
        plan.writes.append((rel, entry, reason))
    return plan


def _is_link(state: MappingState, rel: str, entries: dict[str, RemoteEntry], deleting: set[str]) -> bool:
    entry = entries.get(rel)
    if entry is not None:
        return entry.kind == "link"
    return rel not in deleting and os.path.islink(state.host_path(rel))


def _check_parents(state: MappingState, rel: str, deleting: set[str]) -> None:
    """Refuse a write that would go through a symlink on the host."""
    if state.is_file:
        return
    parts = rel.split("/")
    for i in range(1, len(parts)):
        sub = "/".join(parts[:i])
        if sub in deleting:
            return  # removed before the write; the rest is created fresh
        if os.path.islink(state.host_path(sub)):
            raise UnsafeArchiveError(
                f"archive member {rel!r} would be written through the host symlink "
                f"{state.host_path(sub)!r}; refusing the archive"
            )


def _stage_copy(state: MappingState, tree: RemoteTree, entry: RemoteEntry, host: dict[str, Stat]) -> bool:
    """Stage the content of a hard link whose source did not change remotely."""
    assert entry.copy_of is not None
    src = state.host_path(entry.copy_of)
    st = host.get(entry.copy_of)
    if st is None or st[2] & _S_IFMT == _S_IFLNK or _host_digest(src, st) != entry.digest:
        return False
    stage = tree.stage
    stage.seek(0, os.SEEK_END)
    entry.offset = stage.tell()
    with open(src, "rb") as f:
        shutil.copyfileobj(f, stage)
    entry.size = stage.tell() - entry.offset
    entry.copy_of = None
    return True


def _apply(engine: SyncEngine, plan: _Plan, out: _Outcome, report: ProgressCallback | None, done: int, total: int) -> int:
    from .engine import SyncProgress

    state = plan.state

    def step(path: str) -> int:
        nonlocal done
        done += 1
        engine._trace("apply-file", path)
        if report is not None:
            report(SyncProgress("pull", done, total, 0, 0))
        return done

    for rel in plan.forget:
        state.stats.pop(rel, None)
        state.hashes.pop(rel, None)
    for rel in plan.deletes:
        path = state.host_path(rel)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            out.skipped.append((path, f"could not delete: {exc}"))
            step(path)
            continue
        state.stats.pop(rel, None)
        state.hashes.pop(rel, None)
        out.deleted.append(path)
        step(path)
    _prune_dirs(state, plan)
    for rel, st, digest in plan.records:
        state.stats[rel] = st
        state.hashes[rel] = digest
    for rel in sorted(plan.mkdirs, key=lambda r: r.count("/")):
        path = state.host_path(rel)
        with contextlib.suppress(OSError):
            if not _parents_safe(state, rel):
                continue
            os.makedirs(path, exist_ok=True)
    for rel, entry, reason in plan.writes:
        path = state.host_path(rel)
        try:
            existed, backup = _write(state, plan.tree, rel, entry, reason is not None)
        except _Skip as skip:
            out.skipped.append((path, str(skip)))
            step(path)
            continue
        except OSError as exc:
            out.skipped.append((path, f"could not write: {exc}"))
            step(path)
            continue
        if reason is not None:
            out.conflicts.append(SyncConflict(path, reason, backup))
        (out.updated if existed else out.created).append(path)
        step(path)
    return done


class _Skip(Exception):
    pass


def _prune_dirs(state: MappingState, plan: _Plan) -> None:
    """Remove host directories the target removed, once deleting left them empty."""
    if state.is_file or not plan.deletes:
        return
    entries = plan.tree.entries
    dirs: set[str] = set()
    for rel in plan.deletes:
        parent = posixpath.dirname(rel)
        while parent and parent not in entries:
            dirs.add(parent)
            parent = posixpath.dirname(parent)
    for rel in sorted(dirs, key=lambda r: -r.count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(state.host_path(rel))  # fails, as it should, when anything is left


def _parents_safe(state: MappingState, rel: str) -> bool:
    """Checked again right before writing: every parent is a real directory or absent."""
    if state.is_file:
        return True
    parts = rel.split("/")
    for i in range(1, len(parts)):
        path = state.host_path("/".join(parts[:i]))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return True
        if st.st_mode & _S_IFMT != 0o040000:
            return False
    return True


def _backup_name(path: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    candidate = f"{path}{CONFLICT_MARKER}{stamp}"
    n = 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}{CONFLICT_MARKER}{stamp}-{n}"
    return candidate


def _write(state: MappingState, tree: RemoteTree, rel: str, entry: RemoteEntry, conflict: bool) -> tuple[bool, str | None]:
    """Write one file or symlink atomically; returns (existed before, backup path)."""
    path = state.host_path(rel)
    if not _parents_safe(state, rel):
        raise _Skip("a parent directory on the host is a file or a symlink")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.hermes-tmp-{secrets.token_hex(4)}")
    try:
        if entry.kind == "link":
            os.symlink(entry.target, tmp)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                if entry.size:
                    if entry.offset < 0:
                        raise SyncError(f"no staged content for {rel!r}")
                    for chunk in tree.chunks(entry):
                        _write_all(fd, chunk)
                os.fchmod(fd, entry.mode)
            finally:
                os.close(fd)
            os.utime(tmp, (entry.mtime, entry.mtime))
        existed = os.path.lexists(path)
        if existed and os.path.isdir(path) and not os.path.islink(path):
            try:
                os.rmdir(path)
            except OSError:
                raise _Skip("the host has a non-empty directory there") from None
        backup = None
        if conflict and existed:
            backup = _backup_name(path)
            try:
                os.link(path, backup, follow_symlinks=False)
            except OSError:
                shutil.copy2(path, backup, follow_symlinks=False)
        os.replace(tmp, path)
        tmp = ""
    finally:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    st = os.lstat(path)
    state.stats[rel] = (st.st_mtime_ns, st.st_size, st.st_mode)
    assert entry.digest is not None
    state.hashes[rel] = entry.digest
    return existed, backup


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
