"""Creating environments by name, and a pool of them keyed by task id.

``create_environment()`` resolves the backend and its options (see ``config``)
and builds the environment; ``EnvironmentPool`` reuses one per task and closes
those left idle. Whatever either created is closed at interpreter exit.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .config import ConfigFile, ResolvedConfig, resolve_config
from .environment.base import BaseEnvironment
from .errors import EnvironmentClosedError, PluginLoadError
from .plugins.registry import BackendRegistry, get_registry

__all__ = ["EnvironmentFactory", "EnvironmentPool", "create_environment"]

log = logging.getLogger(__name__)

# Environments and pools to close at exit; weak, so this never keeps one alive.
_live_envs: weakref.WeakSet[BaseEnvironment] = weakref.WeakSet()
_live_pools: weakref.WeakSet[EnvironmentPool] = weakref.WeakSet()
_live_lock = threading.Lock()


class EnvironmentFactory:
    """Resolves configuration against one registry, environment and config file, and builds environments.

    ``environ`` defaults to ``os.environ`` read at each call; ``config_file`` to
    ``$HERMES_ENV_CONFIG`` or ``./hermes-env.toml``.
    """

    def __init__(
        self,
        registry: BackendRegistry | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        config_file: str | os.PathLike[str] | ConfigFile | None = None,
    ) -> None:
        self._registry = registry
        self.environ = environ
        self.config_file = config_file

    @property
    def registry(self) -> BackendRegistry:
        return self._registry if self._registry is not None else get_registry()

    def resolve(
        self, name: str | None = None, /, *, option_strings: Mapping[str, str] | None = None, **options: Any
    ) -> ResolvedConfig:
        return resolve_config(
            name,
            options,
            option_strings=option_strings,
            registry=self.registry,
            environ=self.environ,
            config_file=self.config_file,
        )

    def create(
        self, name: str | None = None, /, *, option_strings: Mapping[str, str] | None = None, **options: Any
    ) -> BaseEnvironment:
        """Create an environment of backend ``name`` (or ``backend=``) with ``options``; see ``create_environment``."""
        name = _backend_argument(name, options)
        if options.get("snapshot") is not None:
            # A new session from a snapshot: its files, then its state (environment.snapshot_files).
            from .environment.snapshot_files import environment_from_snapshot

            snapshot, restore_to = options.pop("snapshot"), options.pop("restore_to", None)
            return environment_from_snapshot(self, name, snapshot, options, restore_to=restore_to)
        options.pop("snapshot", None)
        if options.get("session") is not None:
            from .environment.named import open_session

            session = options.pop("session")
            extra = {k: options.pop(k) for k in ("wait", "restore", "session_idle_timeout") if k in options}
            return open_session(
                self, session, name, options, option_strings=dict(option_strings or {}),
                wait=extra.get("wait", True), restore=extra.get("restore", False),
                idle_timeout=extra.get("session_idle_timeout"),
            )
        options.pop("session", None)
        resolved = self.resolve(name, option_strings=option_strings, **options)
        return self.create_resolved(resolved)

    def create_resolved(self, resolved: ResolvedConfig) -> BaseEnvironment:
        cls = self.registry.load(resolved.backend)
        try:
            signature: inspect.Signature | None = inspect.signature(cls)
        except (TypeError, ValueError):  # no signature to check (a C type): just try
            signature = None
        try:
            if signature is not None:
                signature.bind(resolved.config)
        except TypeError as exc:
            raise PluginLoadError(
                f"backend {resolved.backend!r}: {cls.__module__}.{cls.__qualname__} does not take its config "
                f"as the first argument: {exc}"
            ) from exc
        env = cls(resolved.config)  # type: ignore[arg-type]  # the backend's own config model (a plugin's may not derive EnvironmentConfig)
        with _live_lock:
            _live_envs.add(env)
        return env


def create_environment(backend: str | None = None, /, **options: Any) -> BaseEnvironment:
    """Create an environment of ``backend`` with ``options``.

    ``create_environment("docker", image="python:3.12")`` or
    ``create_environment(backend="docker", image="python:3.12")``. The backend
    is this argument, else ``$TERMINAL_ENV``, else ``env`` in the
    ``[terminal]`` table of the config file, else ``local``. Note that in
    Python ``env`` is the ``env`` option, the variables commands get
    (``env={"DEBUG": "1"}``), not the backend. Options are, by precedence:
    these arguments > ``TERMINAL_<FIELD>`` variables > the config file > the
    backend's defaults; they are validated by the backend's config model, and
    an unknown key is a ``ConfigError`` naming it.
    ``snapshot=`` (a ``Snapshot`` or a stored snapshot's name) starts the session from it (files,
    then state); ``restore_to=`` is where a local or ssh snapshot's files go (default a fresh
    directory, removed at close).

    ``session="NAME"`` attaches to the named session NAME, or creates it: its
    shell outlives this object (``env.detach()``) until ``close()`` ends it.
    With it: ``wait=False`` raises ``SessionBusyError`` instead of waiting while
    another process is attached; ``restore=True`` restores the last checkpoint
    of a lost session into a new target; ``session_idle_timeout`` (seconds)
    ends the session once nobody attached for that long.
    """
    return EnvironmentFactory().create(backend, **options)


def _backend_argument(positional: str | None, options: dict[str, Any]) -> str | None:
    """The backend from the positional argument or ``backend=`` (one of them), removed from ``options``."""
    if "backend" not in options:
        return positional
    keyword = options.pop("backend")
    if positional is not None and keyword is not None and positional != keyword:
        raise TypeError(f"the backend is given twice: {positional!r} and backend={keyword!r}")
    return positional if positional is not None else keyword


@dataclass
class _Entry:
    env: BaseEnvironment
    last_used: float
    inflight: int = 0


class EnvironmentPool:
    """One environment per task id, created on first ``get()``, closed after ``idle_timeout`` unused.

    An environment counts as used while a command runs on it (its ``execute``
    is tracked) and as idle from the end of the last command, or from the last
    ``get()``. It is never reaped while ``_has_live_processes()`` is true. The
    reaper is a daemon thread that wakes every ``reap_interval`` seconds and is
    stopped by ``close_all()``; ``idle_timeout=None`` disables reaping. All
    methods are thread-safe; environments for different task ids are created
    in parallel, concurrent ``get()`` calls for one task id share one creation.
    """

    def __init__(
        self,
        backend: str | None = None,
        /,
        *,
        idle_timeout: float | None = 600.0,
        reap_interval: float | None = None,
        factory: Callable[..., BaseEnvironment] | EnvironmentFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        **options: Any,
    ) -> None:
        if idle_timeout is not None and idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive (or None to disable reaping)")
        self.backend = backend
        self.options = options
        self.idle_timeout = idle_timeout
        if reap_interval is None and idle_timeout is not None:
            reap_interval = min(max(idle_timeout / 4, 0.01), 30.0)
        self.reap_interval = reap_interval
        if isinstance(factory, EnvironmentFactory):
            factory = factory.create
        self._factory: Callable[..., BaseEnvironment] = factory or create_environment
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._creating: dict[str, Future[BaseEnvironment]] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self._closed = False
        with _live_lock:
            _live_pools.add(self)

    # -- public API ---------------------------------------------------------------
    def get(self, task_id: str, **overrides: Any) -> BaseEnvironment:
        """The environment for ``task_id``, created if needed (``overrides`` apply only then)."""
        while True:
            with self._lock:
                if self._closed:
                    raise EnvironmentClosedError("the environment pool is closed")
                entry = self._entries.get(task_id)
                if entry is not None and not entry.env.closed:
                    entry.last_used = self._clock()
                    return entry.env
                if entry is not None:  # closed behind our back: make a new one
                    del self._entries[task_id]
                future = self._creating.get(task_id)
                creator = future is None
                if creator:
                    future = self._creating[task_id] = Future()
            assert future is not None
            if not creator:
                env = future.result()
                if not env.closed:
                    return env
                continue
            return self._create(task_id, future, overrides)

    def close(self, task_id: str) -> bool:
        """Close and forget the environment of ``task_id``; False if there was none."""
        with self._lock:
            entry = self._entries.pop(task_id, None)
        if entry is None:
            return False
        _close_quietly(entry.env, task_id)
        return True

    def reap_idle(self) -> list[str]:
        """Close every environment idle for ``idle_timeout``; returns their task ids. The reaper calls this."""
        if self.idle_timeout is None:
            return []
        now = self._clock()
        with self._lock:
            candidates = [
                (tid, e, e.last_used)
                for tid, e in self._entries.items()
                if e.inflight == 0 and now - e.last_used >= self.idle_timeout
            ]
        reaped = []
        for tid, entry, seen in candidates:
            # Asked outside the lock: a remote backend may take a while to answer.
            if _has_live_processes(entry.env, tid):
                continue
            with self._lock:
                current = self._entries.get(tid)
                if current is not entry or entry.inflight or entry.last_used != seen:
                    continue  # used again meanwhile
                del self._entries[tid]
            _close_quietly(entry.env, tid)
            reaped.append(tid)
        return reaped

    def close_all(self) -> None:
        """Stop the reaper and close every environment; the pool cannot be used afterwards."""
        with self._lock:
            self._closed = True
            entries = list(self._entries.items())
            self._entries.clear()
            reaper, self._reaper = self._reaper, None
        self._stop.set()
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(timeout=10.0)
        for tid, entry in entries:
            _close_quietly(entry.env, tid)

    @property
    def closed(self) -> bool:
        return self._closed

    def task_ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, task_id: object) -> bool:
        with self._lock:
            return task_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __enter__(self) -> EnvironmentPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()

    # -- internals ----------------------------------------------------------------
    def _create(self, task_id: str, future: Future[BaseEnvironment], overrides: Mapping[str, Any]) -> BaseEnvironment:
        options = {**self.options, **overrides, "task_id": task_id}
        try:
            env = self._factory(self.backend, **options)
        except BaseException as exc:
            with self._lock:
                self._creating.pop(task_id, None)
            future.set_exception(exc)
            raise
        entry = _Entry(env, self._clock())
        self._track(entry)
        with self._lock:
            self._creating.pop(task_id, None)
            closed = self._closed
            if not closed:
                entry.last_used = self._clock()
                self._entries[task_id] = entry
                self._start_reaper()
        if closed:
            _close_quietly(env, task_id)
            error = EnvironmentClosedError("the environment pool was closed while the environment was created")
            future.set_exception(error)
            raise error
        future.set_result(env)
        return env

    def _track(self, entry: _Entry) -> None:
        # BaseEnvironment does not say whether a command is running; wrap this
        # instance's execute() so the reaper never closes a busy environment.
        env = entry.env
        inner = env.execute
        pool_ref = weakref.ref(self)

        @functools.wraps(inner)
        def execute(*args: Any, **kwargs: Any) -> Any:
            pool = pool_ref()
            if pool is None:
                return inner(*args, **kwargs)
            with pool._lock:
                entry.inflight += 1
                entry.last_used = pool._clock()
            try:
                return inner(*args, **kwargs)
            finally:
                with pool._lock:
                    entry.inflight -= 1
                    entry.last_used = pool._clock()

        env.execute = execute  # type: ignore[method-assign]

    def _start_reaper(self) -> None:
        # Called with self._lock held.
        if self.idle_timeout is None or self._reaper is not None:
            return
        ref = weakref.ref(self)
        stop, interval = self._stop, self.reap_interval
        thread = threading.Thread(
            target=_reap_loop, args=(ref, stop, interval), name="hermes-env-pool-reaper", daemon=True
        )
        self._reaper = thread
        thread.start()


def _reap_loop(ref: weakref.ref[EnvironmentPool], stop: threading.Event, interval: float) -> None:
    # Holds the pool only weakly between rounds, so an abandoned pool can be collected.
    while not stop.wait(interval):
        pool = ref()
        if pool is None:
            return
        try:
            pool.reap_idle()
        except Exception:  # keep reaping; one bad environment must not stop the rest
            log.exception("hermes-env: reaping idle environments failed")
        del pool


def _has_live_processes(env: BaseEnvironment, task_id: str) -> bool:
    try:
        return bool(env._has_live_processes())
    except Exception:
        log.warning("hermes-env: could not ask environment %r about live processes; keeping it", task_id, exc_info=True)
        return True


def _close_quietly(env: BaseEnvironment, task_id: str) -> None:
    try:
        env.close()
    except Exception:
        log.warning("hermes-env: closing environment %r failed", task_id, exc_info=True)


@atexit.register
def _close_everything_at_exit() -> None:
    with _live_lock:
        pools = list(_live_pools)
        envs = list(_live_envs)
    for pool in pools:
        pool.close_all()
    for env in envs:
        if not env.closed and env._named is not None:
            try:
                env.detach()  # a named session outlives the process that attached it
            except Exception:  # noqa: BLE001 - at exit, nothing to raise to
                log.debug("detaching %r at exit failed", env, exc_info=True)
        elif not env.closed:
            _close_quietly(env, env.task_id)
