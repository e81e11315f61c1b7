"""``SyncEngine``: pushes host trees to a target before each command and pulls
the target's changes back, over any ``FileSyncTransport``.

Change detection is here and only here: (mtime_ns, size, mode) from one scan,
SHA-256 of what was pushed, bookkeeping committed only when a transfer succeeds.
"""

from __future__ import annotations

import functools
import os
import posixpath
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, cast

from ..errors import ConfigError, SyncConflictError, SyncError, UnsafeArchiveError
from .archive import DEFAULT_MAX_BYTES, DEFAULT_MAX_MEMBERS, PushArchive, StreamReader
from .filters import Stat
from .journal import PendingPull, SyncJournal
from .mapping import MappingState, SyncMapping
from .transport import FileSyncTransport, TransportError, is_transient

if TYPE_CHECKING:
    from .pull import PullResult

__all__ = [
    "FORCE_ENV",
    "PushResult",
    "RetryPolicy",
    "SyncEngine",
    "SyncProgress",
]

#: Set to 1 to make every push skip the rate limit.
FORCE_ENV = "HERMES_ENV_FORCE_SYNC"


@dataclass(frozen=True)
class SyncProgress:
    """How far a push (or the apply step of a pull) has got.

    For a push, bytes count file content (not tar overhead) and advance as the
    transport takes the stream, so the callback may run on the transport's
    feeding thread; after a retry the counts start again. For a pull, only
    files are counted (actions applied to the host).
    """

    phase: str  # "push" or "pull"
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int


ProgressCallback = Callable[[SyncProgress], None]
TraceHook = Callable[[str, str], None]


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for transient transport errors: ``attempts`` tries in all,
    waiting ``initial_delay`` then multiplying by ``factor`` up to ``max_delay``."""

    attempts: int = 4
    initial_delay: float = 0.2
    factor: float = 2.0
    max_delay: float = 3.0


@dataclass(frozen=True)
class PushResult:
    """What one ``push()`` did. ``skipped`` means the rate limit held it back."""

    skipped: bool = False
    checked: int = 0  # files scanned
    uploaded: tuple[str, ...] = ()  # remote paths
    deleted: tuple[str, ...] = ()  # remote paths
    unreadable: tuple[str, ...] = ()  # host paths that could not be read (retried next time)
    bytes_sent: int = 0
    duration_s: float = 0.0

    @property
    def changed(self) -> bool:
        return bool(self.uploaded or self.deleted)


def _forced_by_env() -> bool:
    return os.environ.get(FORCE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class SyncEngine:
    """Keeps a set of ``SyncMapping`` trees in step with one target.

    A remote backend makes one per environment, calls ``push()`` from its
    ``_before_execute()`` hook and ``pull()`` from ``cleanup()`` (and whenever
    the user asks). Thread-safe; pushes and pulls of one engine never overlap.
    """

    def __init__(
        self,
        transport: FileSyncTransport,
        mappings: Sequence[SyncMapping],
        *,
        interval: float = 5.0,
        max_archive_bytes: int = DEFAULT_MAX_BYTES,
        max_members: int = DEFAULT_MAX_MEMBERS,
        retry: RetryPolicy = RetryPolicy(),
        lock_dir: str | None = None,
        lock_timeout: float | None = 600.0,
        progress: ProgressCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        trace: TraceHook | None = None,
        journal: SyncJournal | None = None,
    ) -> None:
        if interval < 0:
            raise ConfigError(f"sync interval must be >= 0 seconds, not {interval!r}")
        if max_archive_bytes <= 0:
            raise ConfigError(f"max_archive_bytes must be positive, not {max_archive_bytes!r}")
        self.transport = transport
        self.interval = float(interval)
        self.max_archive_bytes = int(max_archive_bytes)
        self.max_members = int(max_members)
        self.retry = retry
        self.lock_dir = lock_dir
        self.lock_timeout = lock_timeout
        self.progress = progress
        self._clock = clock
        self._sleep = sleep
        self._trace_hook = trace
        self._mutex = threading.RLock()
        self._checked_at: float | None = None
        self._maps = [MappingState.resolve(m) for m in mappings]
        for state in self._maps:
            state.set_foreign(self._maps)
        self.journal = journal
        # Mappings whose pull-back failed: the target may hold changes the
        # host has not got, so pushes are refused until a pull succeeds.
        self._pending: dict[int, PendingPull] = {}
        if journal is not None:
            for i, state in enumerate(self._maps):
                if not state.mapping.upload_only and (found := journal.load(state)) is not None:
                    self._pending[i] = found

    @property
    def pending(self) -> tuple[PendingPull, ...]:
        """Pull-backs that failed and were not made good since (pushes are refused meanwhile)."""
        return tuple(self._pending.values())

    @property
    def mappings(self) -> tuple[SyncMapping, ...]:
        return tuple(s.mapping for s in self._maps)

    def reset(self) -> None:
        """Forget what was pushed (e.g. the target was recreated): the next
        push uploads every file, and no pull deletes anything before it."""
        with self._mutex:
            for state in self._maps:
                state.stats.clear()
                state.hashes.clear()
                state.doubt.clear()
            self._checked_at = None

    # -- push -----------------------------------------------------------------
    def push(self, *, force: bool = False, progress: ProgressCallback | None = None) -> PushResult:
        """Send what changed on the host since the last successful push.

        New and changed files travel in one tar stream per remote anchor, files
        removed from the host are deleted in the target. At most one check per
        ``interval`` seconds unless ``force`` or ``HERMES_ENV_FORCE_SYNC=1``.
        On failure nothing is recorded, so the next push retries it all; the
        error is a ``SyncError``.
        """
        report = progress or self.progress
        with self._mutex:
            if self._pending:
                raise SyncConflictError(
                    "push refused: the target may hold changes that were never pulled back, and pushing would "
                    "overwrite them: " + "; ".join(p.describe() for p in self._pending.values())
                    + ". Pull them first (env.pull_files(), or `hermes-env pull` with the same options); "
                    "files changed on both sides are then kept as .hermes-conflict-* backups",
                    pending=tuple(self._pending.values()),
                )
            now = self._clock()
            if (
                not force
                and self._checked_at is not None
                and now - self._checked_at < self.interval
                and not _forced_by_env()
            ):
                return PushResult(skipped=True)
            started = time.perf_counter()
            scans: list[dict[str, Stat]] = []
            work = False
            checked = 0
            for state in self._maps:
                cur = state.scan()
                scans.append(cur)
                checked += len(cur)
                if cur != state.stats or state.doubt:
                    work = True
            if not work:
                self._checked_at = now
                return PushResult(checked=checked, duration_s=time.perf_counter() - started)
            result = self._push_changes(scans, report, checked, started)
            self._checked_at = now
            return result

    def _push_changes(
        self, scans: list[dict[str, Stat]], report: ProgressCallback | None, checked: int, started: float
    ) -> PushResult:
        jobs: dict[str, list[tuple[_Commit, str, Stat]]] = {}
        deletes: dict[str, tuple[list[str], set[str]]] = {}
        commits: list[_Commit] = []
        for state, cur in zip(self._maps, scans):
            prev, doubt = state.stats, state.doubt
            commit = _Commit(state)
            commits.append(commit)
            for rel, st in cur.items():
                if prev.get(rel) != st or rel in doubt:
                    jobs.setdefault(state.anchor, []).append((commit, rel, st))
            commit.gone = [rel for rel in prev if rel not in cur]
            commit.gone.extend(rel for rel in doubt if rel not in cur and rel not in prev)
            if commit.gone:
                files, dirs = deletes.setdefault(state.anchor, ([], set()))
                for rel in commit.gone:
                    files.append(state.member(rel))
                    if not state.is_file:
                        dirs.update(self._vanished_dirs(state, rel))
        files_total = sum(len(items) for items in jobs.values())
        bytes_total = sum(st[1] for items in jobs.values() for _, _, st in items)
        archives = {anchor: PushArchive() for anchor in jobs}
        cancel = threading.Event()
        # Files are read and archived on a thread while the transport already
        # sends the start of the stream: the target extracts as we read.
        producer = threading.Thread(target=_produce, args=(jobs, archives, cancel), name="hermes-sync-push", daemon=True)
        try:
            if report is not None:
                report(SyncProgress("push", 0, files_total, 0, bytes_total))
            for anchor, (files, dirs) in deletes.items():
                ordered = sorted(dirs, key=lambda d: (-d.count("/"), d))
                self._trace("push-delete", f"{anchor}: {len(files)} files")
                self._with_retry(f"deleting {len(files)} files under {anchor!r}",
                                 functools.partial(self.transport.delete, anchor, files, ordered))
            producer.start()
            done_files = done_bytes = 0
            for anchor, arch in archives.items():
                if arch.wait_started():
                    self._upload(anchor, arch, report, done_files, done_bytes, files_total, bytes_total)
                with arch.cond:
                    while not arch.done:
                        arch.cond.wait()
                if arch.error is not None:
                    raise arch.error
                done_files += arch.members
                done_bytes += arch.marks[-1][1] if arch.marks else 0
            if report is not None:
                report(SyncProgress("push", files_total, files_total, bytes_total, bytes_total))
        except BaseException as exc:
            # Whatever was in flight is in doubt: retried by the next push, and
            # never taken for a change made in the target by a pull.
            cancel.set()
            if producer.is_alive():
                producer.join()
            for commit in commits:
                commit.state.doubt.update(rel for items in jobs.values() for c, rel, _ in items if c is commit)
                commit.state.doubt.update(commit.gone)
            self._checked_at = None
            if isinstance(exc, SyncError) or not isinstance(exc, Exception):
                raise
            raise SyncError(f"push failed: {exc!r}") from exc
        finally:
            if producer.is_alive():
                producer.join()
            for arch in archives.values():
                arch.close()
        uploaded: list[str] = []
        deleted: list[str] = []
        unreadable: list[str] = []
        for commit in commits:
            state = commit.state
            state.stats.update(commit.stats)
            state.hashes.update(commit.hashes)
            for rel in commit.gone:
                state.stats.pop(rel, None)
                state.hashes.pop(rel, None)
            state.doubt.difference_update(commit.stats)
            state.doubt.difference_update(commit.gone)
            uploaded.extend(self._remote_name(state, rel) for rel in commit.uploaded)
            deleted.extend(self._remote_name(state, rel) for rel in commit.gone)
            unreadable.extend(commit.unreadable)
        return PushResult(
            checked=checked,
            uploaded=tuple(uploaded),
            deleted=tuple(deleted),
            unreadable=tuple(unreadable),
            bytes_sent=sum(a.size for a in archives.values() if a.members),
            duration_s=time.perf_counter() - started,
        )

    def _upload(self, anchor: str, arch: PushArchive, report: ProgressCallback | None,
                base_files: int, base_bytes: int, files_total: int, bytes_total: int) -> None:
        attempts = [0]

        def progress(content: int, files: int) -> None:
            assert report is not None
            report(SyncProgress("push", base_files + files, files_total, base_bytes + content, bytes_total))

        streams = getattr(self.transport, "streams_upload", False)

        def send() -> None:
            attempts[0] += 1
            with arch.cond:
                if attempts[0] > 1 or not streams:  # a retry sends the finished archive
                    arch.cond.wait_for(lambda: arch.done)
                size = arch.size if arch.done else None
            if arch.error is not None:
                raise arch.error
            reader = StreamReader(arch, progress if report is not None else None)
            self._trace("push-upload", f"{anchor}: attempt {attempts[0]}")
            self.transport.upload(anchor, cast(BinaryIO, reader), size)
            with arch.cond:
                arch.cond.wait_for(lambda: arch.done)
            if arch.error is not None:
                raise arch.error
            if reader.high != arch.size:
                raise TransportError(
                    f"the transport returned after sending {reader.high} of the {arch.size} bytes of the push archive"
                )

        self._with_retry(f"uploading {files_total} files to {anchor!r}", send)

    @staticmethod
    def _remote_name(state: MappingState, rel: str) -> str:
        name = state.member(rel)
        return "/" + name if state.anchor == "/" else name

    @staticmethod
    def _vanished_dirs(state: MappingState, rel: str) -> list[str]:
        """Parent directories of a removed file that the host no longer has."""
        out = []
        parent = posixpath.dirname(rel)
        while parent:
            if os.path.isdir(state.host_path(parent)):
                break
            out.append(state.member(parent))
            parent = posixpath.dirname(parent)
        return out

    # -- pull -----------------------------------------------------------------
    def pull(self, *, progress: ProgressCallback | None = None) -> PullResult:
        """Bring the target's changes back to the host; see ``pull.py``.

        Returns a ``PullResult``. Raises ``UnsafeArchiveError`` (nothing
        written) for a hostile archive and ``SyncError`` when the target could
        not be read after the retries.
        """
        from .pull import run_pull

        with self._mutex:
            try:
                result = run_pull(self, progress or self.progress)
            except UnsafeArchiveError:
                raise  # tampering: reported, and what the target holds is not wanted
            except BaseException as exc:
                why = str(exc) or type(exc).__name__
                where = self._record_failed_pull(why)
                if not isinstance(exc, Exception):
                    raise
                raise SyncError(
                    f"pull-back failed: {why}; the target's changes stay there, and pushes are refused until "
                    f"a pull succeeds{where}"
                ) from exc
            for i, state in enumerate(self._maps):
                self._pending.pop(i, None)
                if self.journal is not None and not state.mapping.upload_only:
                    self.journal.clear(state)
            return result

    def _record_failed_pull(self, why: str) -> str:
        """Keep what is known of each pulled mapping, on disk when there is a journal."""
        saved = ""
        for i, state in enumerate(self._maps):
            if state.mapping.upload_only:
                continue
            pending = PendingPull(self.journal.target if self.journal else "target", state.host_root,
                                  state.remote_path, time.time(), why)
            if self.journal is not None:
                try:
                    pending = self.journal.record(state, why)
                    saved = f" (recorded in {self.journal.directory})"
                except OSError as exc:
                    saved = f" (could not be recorded on disk: {exc}; only this engine knows)"
            self._pending[i] = pending
        return saved

    # -- helpers shared with pull.py -------------------------------------------
    def _trace(self, event: str, detail: str = "") -> None:
        if self._trace_hook is not None:
            self._trace_hook(event, detail)

    def _with_retry(self, what: str, fn: Callable[[], object]) -> object:
        delay = self.retry.initial_delay
        attempts = max(1, self.retry.attempts)
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except UnsafeArchiveError:
                raise
            except Exception as exc:
                if not is_transient(exc):
                    if isinstance(exc, SyncError):
                        raise
                    raise SyncError(f"{what} failed: {exc!r}") from exc
                if attempt == attempts:
                    raise TransportError(f"{what} failed after {attempts} attempts: {exc}", transient=True) from exc
                self._trace("retry", f"{what}: attempt {attempt} failed: {exc}")
                self._sleep(delay)
                delay = min(delay * self.retry.factor, self.retry.max_delay)
        raise AssertionError("unreachable")


class _Commit:
    """What one push will record for one mapping, once the transfer succeeded."""

    __slots__ = ("gone", "hashes", "state", "stats", "unreadable", "uploaded")

    def __init__(self, state: MappingState) -> None:
        self.state = state
        self.stats: dict[str, Stat] = {}
        self.hashes: dict[str, bytes] = {}
        self.gone: list[str] = []
        self.uploaded: list[str] = []
        self.unreadable: list[str] = []


def _produce(jobs: dict[str, list[tuple[_Commit, str, Stat]]], archives: dict[str, PushArchive],
             cancel: threading.Event) -> None:
    """Read, hash and archive the candidate files, anchor after anchor."""
    pending = list(archives.values())
    try:
        for anchor, items in jobs.items():
            arch = archives[anchor]
            for commit, rel, st in items:
                if cancel.is_set():
                    raise SyncError("push cancelled")
                state = commit.state
                path = state.host_path(rel)
                try:
                    digest, data = PushArchive.read(path, st)
                except OSError:
                    commit.unreadable.append(path)
                    continue
                old = state.stats.get(rel)
                if rel not in state.doubt and old is not None and old[2] == st[2] and state.hashes.get(rel) == digest:
                    commit.stats[rel] = st  # touched, not changed
                    commit.hashes[rel] = digest
                    continue
                try:
                    arch.add(state.member(rel), path, st, data)
                except OSError:  # raised before anything of this member was written
                    commit.unreadable.append(path)
                    continue
                commit.stats[rel] = st
                commit.hashes[rel] = digest
                commit.uploaded.append(rel)
            arch.finish()
            pending.remove(arch)
    except BaseException as exc:  # noqa: BLE001 - handed to the sending thread
        for arch in pending:
            arch.finish(exc)
