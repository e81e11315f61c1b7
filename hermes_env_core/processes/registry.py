"""ProcessRegistry: start background processes in any environment and keep track of them.

It owns the completion queue, the checkpoint, the hygiene of finished
processes, and the link to each environment (closing one kills its processes;
the pool never reaps one while they run).
"""

from __future__ import annotations

import atexit
import builtins
import logging
import os
import queue
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self, TypeGuard

from ..environment.base import BaseEnvironment
from ..errors import EnvironmentClosedError, HermesEnvError
from . import procinfo
from .buffer import DEFAULT_BUFFER_BYTES, OutputBuffer
from .checkpoint import Checkpoint
from .events import Notification, NotificationCallback, Notifier
from .hooks import attach
from .local import AdoptedLocalDriver, LocalPipeDriver, LocalPtyDriver
from .prelude import session_script
from .process import (
    BackgroundProcess,
    Driver,
    NotOursDriver,
    ProcessError,
    ProcessStatus,
)
from .sandbox import DEFAULT_POLL, PollSettings, SandboxDriver
from .sandbox_scripts import DEFAULT_BASE
from .watch import DEFAULT_RATE_LIMIT, RateLimit, WatchPattern, WatchSpec, parse_watch

if TYPE_CHECKING:
    from ..backends.local import LocalEnvironment

__all__ = ["ProcessNotFoundError", "ProcessRegistry", "env_key"]

log = logging.getLogger(__name__)


class ProcessNotFoundError(HermesEnvError, KeyError):
    """No background process has this id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no such background process"


def env_key(env: BaseEnvironment) -> str:
    """What identifies ``env``'s target across registries and processes.

    An environment may say it itself (a ``process_scope`` attribute). Else: this
    machine for local; the account for a host-based backend (``host``/``user``
    options, e.g. ssh); the task id for the others (docker reuses a
    persistent container by it).
    """
    scope = getattr(env, "process_scope", None)
    if isinstance(scope, str) and scope:
        return scope
    if env.name == "local":
        return "local"
    cfg = env.config
    host, user = getattr(cfg, "host", None), getattr(cfg, "user", None)
    if isinstance(host, str) and isinstance(user, str):
        port = getattr(cfg, "port", None)
        return f"{env.name}:{user}@{host}" + (f":{port}" if port else "")
    return f"{env.name}:{env.task_id}"


def _is_local(env: BaseEnvironment) -> TypeGuard[LocalEnvironment]:
    from ..backends.local import LocalEnvironment

    return isinstance(env, LocalEnvironment)


class ProcessRegistry:
    """Background processes across environments.

    ``checkpoint``: a file listing live processes, rewritten atomically on
    every change; a registry created on the same file can ``recover()`` them.
    ``keep_finished_s``/``keep_finished``: how long and how many ended
    processes stay listed. ``log_dir``: where ``spawn(log=True)`` writes full
    logs. ``sandbox_dir``: the directory (a bash word) for process files in
    non-local targets. ``input_wait_s``: after this many seconds of silence a
    PTY process blocked reading its terminal gets one ``waiting_for_input``
    notification per wait (None: never looked for).
    """

    def __init__(
        self,
        *,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        rate_limit: RateLimit = DEFAULT_RATE_LIMIT,
        poll: PollSettings = DEFAULT_POLL,
        keep_finished_s: float = 3600.0,
        keep_finished: int = 64,
        checkpoint: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        sandbox_dir: str | None = None,
        on_notification: NotificationCallback | None = None,
        input_wait_s: float | None = 2.0,
    ) -> None:
        if buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be positive, not {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self.rate_limit = rate_limit
        self.poll = poll
        self.keep_finished_s = keep_finished_s
        self.keep_finished = keep_finished
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.sandbox_dir = sandbox_dir
        if input_wait_s is not None and not input_wait_s > 0:
            raise ValueError(f"input_wait_s must be a positive number of seconds or None, not {input_wait_s!r}")
        self.input_wait_s = input_wait_s
        self._notifier = Notifier([on_notification] if on_notification else None)
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()
        self._procs: dict[str, BackgroundProcess] = {}
        self._forgotten: set[str] = set()  # pruned ids, dropped from the checkpoint
        self._closed = False
        self.checkpoint = Checkpoint(checkpoint) if checkpoint is not None else None
        self._pending: dict[str, dict[str, Any]] = {}
        self._local_env: BaseEnvironment | None = None  # for local processes recovered without an environment
        self.history: list[dict[str, Any]] = []  # finished records found in the checkpoint
        if self.checkpoint is not None:
            data = self.checkpoint.load()
            self._pending = {r["id"]: r for r in data["live"]}
            self.history = data["finished"]
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)

    # -- notifications ---------------------------------------------------------------
    @property
    def notifications(self) -> queue.Queue[Notification]:
        """The completion queue: every notification, once, in the order they happened."""
        return self._notifier.queue

    def next_notification(self, timeout: float | None = None) -> Notification | None:
        """The next notification, waiting up to ``timeout`` seconds; None if none came."""
        try:
            return self._notifier.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def add_callback(self, callback: NotificationCallback) -> None:
        self._notifier.add_callback(callback)

    # -- starting --------------------------------------------------------------------
    def spawn(
        self,
        env: BaseEnvironment,
        command: str,
        *,
        pty: bool = False,
        watch: WatchSpec = None,
        notify_on_exit: bool = True,
        detached: bool = False,
        cwd: str | None = None,
        window: tuple[int, int] = (24, 80),
        log: bool | str | os.PathLike[str] = False,
        on_notification: NotificationCallback | None = None,
        buffer_bytes: int | None = None,
    ) -> BackgroundProcess:
        """Start ``command`` in the background in ``env``, with the session's state and cwd.

        ``detached``: the process survives ``env.close()`` and this registry
        (locally it then runs like in a sandbox: output to a file, followed by
        polls; a container it runs in must itself outlive the environment,
        e.g. ``persistent=True``). In a sandbox every process already survives
        a crash of this registry, and its full output is in the target's
        ``<dir>/out``. ``window``: (rows, cols) of the PTY. ``log``: also keep
        the full output in a local file (True: in ``log_dir``).
        """
        if self._closed:
            raise HermesEnvError("the process registry is closed")
        if env.closed:
            raise EnvironmentClosedError(f"{env.name} environment {env.task_id!r} is closed")
        patterns = parse_watch(watch)
        self.prune()
        env.before_command()
        session = env.session
        script = session_script(session, command, cwd=cwd)
        login = env.login_each
        pid_name = self._new_id()
        log_path = self._log_path(pid_name, log)
        log_file = open(log_path, "ab") if log_path else None  # noqa: SIM115 - closed with the process
        driver: Driver
        try:
            if _is_local(env) and not detached:
                child_env = env.process_environment
                bash = env.bash_path
                if pty:
                    child_env.setdefault("TERM", "xterm")
                    driver = LocalPtyDriver(bash=bash, script=script, env=child_env, login=login, size=window)
                    driver.input_wait_s = self.input_wait_s
                else:
                    driver = LocalPipeDriver(bash=bash, script=script, env=child_env, login=login)
            else:
                driver = SandboxDriver.launch(
                    env,
                    name=pid_name,
                    script=script,
                    base=self.sandbox_dir or DEFAULT_BASE,
                    login=login,
                    pty=pty,
                    size=window,
                    poll=self.poll,
                )
                driver.input_wait_s = self.input_wait_s
        except BaseException:
            if log_file is not None:
                log_file.close()
            raise
        proc = self._make(
            env,
            pid_name,
            command,
            driver,
            patterns=patterns,
            notify_on_exit=notify_on_exit,
            pty=pty,
            detached=detached,
            log_path=log_path,
            log_file=log_file,
            on_notification=on_notification,
            buffer_bytes=buffer_bytes,
        )
        driver.start(proc)
        return proc

    def _make(
        self,
        env: BaseEnvironment,
        pid_name: str,
        command: str,
        driver: Driver,
        *,
        patterns: tuple[WatchPattern, ...],
        notify_on_exit: bool,
        pty: bool,
        detached: bool,
        log_path: str | None = None,
        log_file: IO[bytes] | None = None,
        on_notification: NotificationCallback | None = None,
        buffer_bytes: int | None = None,
        started_at: float | None = None,
        start_offset: int = 0,
    ) -> BackgroundProcess:
        buffer = OutputBuffer(buffer_bytes or self.buffer_bytes, start=start_offset, log=log_file)
        proc = BackgroundProcess(
            id=pid_name,
            command=command,
            backend=env.name,
            task_id=env.task_id,
            env_key=env_key(env),
            driver=driver,
            buffer=buffer,
            watch=patterns,
            rate_limit=self.rate_limit,
            notify_on_exit=notify_on_exit,
            notifier=self._notifier,
            callbacks=(on_notification,) if on_notification else (),
            pty=pty,
            detached=detached,
            started_at=started_at,
            log_path=log_path,
            kill_grace_s=env.config.kill_grace_s,
            on_finish=self._finished,
        )
        proc._env_ref = weakref.ref(env)  # type: ignore[attr-defined]
        with self._lock:
            self._procs[pid_name] = proc
        attach(env, self)
        self._save()
        return proc

    def _new_id(self) -> str:
        while True:
            pid_name = "bg-" + os.urandom(4).hex()
            with self._lock:
                if pid_name not in self._procs and pid_name not in self._pending:
                    return pid_name

    def _log_path(self, pid_name: str, log: bool | str | os.PathLike[str]) -> str | None:
        if log is False or log is None:
            return None
        if log is True:
            base = self.log_dir or Path(tempfile.gettempdir()) / f"hermes-env-logs-{os.getuid()}"
            base.mkdir(parents=True, exist_ok=True, mode=0o700)
            return str(base / f"{pid_name}.log")
        return str(Path(log).expanduser())

    # -- looking up ------------------------------------------------------------------
    def get(self, process_id: str) -> BackgroundProcess:
        with self._lock:
            proc = self._procs.get(process_id)
        if proc is None:
            raise ProcessNotFoundError(f"no background process {process_id!r} in this registry")
        return proc

    def __contains__(self, process_id: object) -> bool:
        return process_id in self._procs

    def list(self, env: BaseEnvironment | None = None, *, include_finished: bool = True) -> list[BackgroundProcess]:
        """Processes in start order (of ``env`` only, when given)."""
        self.prune()
        key = env_key(env) if env is not None else None
        with self._lock:
            procs = list(self._procs.values())
        return [p for p in procs if (key is None or p.env_key == key) and (include_finished or p.running)]

    def has_live(self, env: BaseEnvironment) -> bool:
        """True while a process started in ``env`` (by this registry) runs."""
        with self._lock:
            return any(p.running and getattr(p, "_env_ref", lambda: None)() is env for p in self._procs.values())

    @property
    def pending(self) -> builtins.list[dict[str, Any]]:
        """Checkpoint records of live processes not yet recovered."""
        with self._lock:
            return list(self._pending.values())

    # -- hygiene -----------------------------------------------------------------------
    def prune(self) -> builtins.list[str]:
        """Forget ended processes older than ``keep_finished_s`` or beyond ``keep_finished``; their ids."""
        now = time.time()
        with self._lock:
            done = [p for p in self._procs.values() if not p.running]
            done.sort(key=lambda p: p.ended_at or 0)
            drop = [p for p in done if (p.ended_at or now) < now - self.keep_finished_s]
            keep = [p for p in done if p not in drop]
            excess = len(keep) - self.keep_finished
            if excess > 0:
                drop += keep[:excess]
            for p in drop:
                del self._procs[p.id]
                self._forgotten.add(p.id)
        if drop:
            removable = [p._driver for p in drop if isinstance(p._driver, SandboxDriver)]
            if removable:
                threading.Thread(target=_remove_dirs, args=(removable,), daemon=True).start()
            self._save()
        return [p.id for p in drop]

    def forget(self, ids: Iterable[str]) -> builtins.list[str]:
        """Drop ended processes (followed, or only recorded) from the listing and the checkpoint; their ids.

        A running one is kept. Files in the target are removed for the ones followed here.
        """
        wanted = set(ids)
        with self._lock:
            procs = [p for p in self._procs.values() if p.id in wanted and not p.running]
            for p in procs:
                del self._procs[p.id]
            gone = {p.id for p in procs}
            gone |= {i for i in wanted if self._pending.pop(i, None) is not None}
            gone |= {r["id"] for r in self.history if r["id"] in wanted}
            self.history = [r for r in self.history if r["id"] not in gone]
            self._forgotten |= gone
        _remove_dirs([p._driver for p in procs if isinstance(p._driver, SandboxDriver)])
        self._save()
        return sorted(gone)

    def _finished(self, proc: BackgroundProcess) -> None:
        self._save()
        self.prune()

    # -- closing -----------------------------------------------------------------------
    def close_environment(self, env: BaseEnvironment) -> None:
        """``env`` is closing: kill its processes, except detached ones, which are left running unfollowed."""
        with self._lock:
            procs = [p for p in self._procs.values() if p.running and getattr(p, "_env_ref", lambda: None)() is env]
        self._shutdown(procs, f"{env.name} environment {env.task_id!r} closed")

    def close(self) -> None:
        """Kill every process not started detached; stop following the others."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            procs = [p for p in self._procs.values() if p.running]
        self._shutdown(procs, "process registry closed")
        self._notifier.close()
        self._close_local_env()

    def _close_local_env(self) -> None:
        env, self._local_env = self._local_env, None
        if env is not None:
            env.close()

    def release(self) -> None:
        """Stop following every process without killing any (they stay in the checkpoint as live).

        For a short-lived owner such as one CLI command: a later registry
        recovers them. Afterwards closing an environment kills nothing.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            procs = [p for p in self._procs.values() if p.running]
        self._shutdown(procs, "its registry was released", kill=False)
        self._notifier.close()
        self._close_local_env()

    def _shutdown(self, procs: Iterable[BackgroundProcess], why: str, *, kill: bool = True) -> None:
        killers = []
        for p in procs:
            if not kill or p.detached or not p.followed:
                p._unfollow(f"still running, no longer followed: {why}")
                continue
            t = threading.Thread(target=_kill_quietly, args=(p,), daemon=True)
            t.start()
            killers.append(t)
        for t in killers:
            t.join(60.0)
        self._save()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- checkpoint and recovery ---------------------------------------------------------
    def _record(self, p: BackgroundProcess) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "id": p.id,
            "command": p.command,
            "backend": p.backend,
            "task_id": p.task_id,
            "env_key": p.env_key,
            "pty": p.pty,
            "detached": p.detached,
            "started_at": p.started_at,
            "notify_on_exit": p.notify_on_exit,
            "watch": [w.to_record() for w in p.patterns],
            "log_path": p.log_path,
            "status": p.status.value,
        }
        rec.update(p._driver.record())
        if not p.running:
            rec.update(exit_code=p.exit_code, ended_at=p.ended_at, note=p.note)
        return rec

    def _save(self) -> None:
        if self.checkpoint is None:
            return
        # One writer at a time, so an older picture never overwrites a newer one.
        with self._save_lock:
            self._save_locked(self.checkpoint)

    def _save_locked(self, checkpoint: Checkpoint) -> None:
        with self._lock:
            procs = list(self._procs.values())
            owned = set(self._procs) | self._forgotten
        live = [self._record(p) for p in procs if p.running]
        finished = [self._record(p) for p in procs if not p.running]
        try:
            checkpoint.update(
                owned=owned,
                live=live,
                finished=finished,
                keep_finished=self.keep_finished,
                keep_finished_s=self.keep_finished_s,
            )
        except OSError as exc:
            log.warning("hermes-env: cannot write the process checkpoint %s: %s", checkpoint.path, exc)
            return
        with self._lock:
            self._forgotten -= owned  # gone from the file now

    def recover(self, env: BaseEnvironment | None = None) -> builtins.list[BackgroundProcess]:
        """Take back the checkpoint's live processes that belong to ``env``'s target.

        One whose pid still belongs to the same process (same start time) is
        adopted and followed again; any other is marked lost (a LOST
        notification) and never signalled. Local processes that ran on a pipe
        or PTY lost their output with their old owner: they are watched and
        killable, their exit code unknown. Without ``env``, only those.
        """
        key = env_key(env) if env is not None else "local"
        with self._lock:
            mine = [r for r in self._pending.values() if r.get("env_key") == key]
        out: list[BackgroundProcess] = []
        for rec in mine:
            if rec.get("driver") == "sandbox":
                if env is None:
                    continue
                try:
                    proc = self._recover_sandbox(env, rec)
                except ProcessError:
                    continue  # stays pending
            else:
                proc = self._recover_local(env, rec)
            with self._lock:
                self._pending.pop(rec["id"], None)
            if proc is not None:
                out.append(proc)
        self._save()
        return out

    def _placeholder_env(self, env: BaseEnvironment | None) -> BaseEnvironment:
        if env is not None:
            return env
        if self._local_env is None:
            from ..backends.local import LocalEnvironment

            self._local_env = LocalEnvironment()
        return self._local_env

    def _recover_local(self, env: BaseEnvironment | None, rec: dict[str, Any]) -> BackgroundProcess | None:
        pid, started = int(rec.get("pid") or 0), rec.get("start_time")
        pidfd = procinfo.open_pidfd(pid) if pid > 0 else None
        # With the pidfd open first, the process checked is the one later signalled.
        st = procinfo.proc_stat(pid) if pid > 0 else None
        same = st is not None and st.state not in ("Z", "X") and started is not None and st.start_time == int(started)
        if not same:
            if pidfd is not None:
                os.close(pidfd)
            why = "is no longer running" if st is None or st.state in ("Z", "X") else "now belongs to another process"
            return self._lost(env, rec, f"pid {pid} {why}; not adopted")
        driver = AdoptedLocalDriver(pid, int(started), rec.get("pgid"), pidfd)  # type: ignore[arg-type]
        proc = self._adopted(env, rec, driver)
        proc.note = "adopted from a checkpoint: earlier output and stdin are gone with the old registry"
        driver.start(proc)
        return proc

    def _recover_sandbox(self, env: BaseEnvironment, rec: dict[str, Any]) -> BackgroundProcess | None:
        try:
            driver = SandboxDriver(
                env,
                dir=str(rec["dir"]),
                pid=(int(rec["pid"]), int(rec["start_time"])),
                wrapper=(int(rec["wrapper_pid"]), int(rec["wrapper_start"])),
                pty=bool(rec.get("pty")),
                poll=self.poll,
            )
        except (KeyError, TypeError, ValueError) as exc:
            return self._lost(env, rec, f"its checkpoint record is incomplete: {exc!r}")
        try:
            state, code, size = driver.check()
        except ProcessError as exc:
            # The target did not answer: that says nothing about the process. Try again later.
            log.warning("hermes-env: cannot check background process %s: %s", rec["id"], exc)
            raise
        if state not in ("alive", "exited"):
            why = {"reused": "its pid now belongs to another process", "dead": "it ended without recording an exit code",
                   "gone": "its directory in the target is gone"}.get(state, state)
            return self._lost(env, rec, f"{why}; not adopted")
        start = max(0, size - self.buffer_bytes)
        proc = self._adopted(env, rec, driver, start_offset=start)
        # Output written while nobody followed: into the buffer, not matched
        # (matches in it may have been reported already).
        if size > start:
            try:
                proc._buffer.append(driver.read_log(start, size - start))
            except ProcessError:
                pass
        driver.offset = proc._buffer.end
        if state == "exited":
            proc._finish(code)
        else:
            driver.start(proc)
        return proc

    def _adopted(
        self, env: BaseEnvironment | None, rec: dict[str, Any], driver: Driver, *, start_offset: int = 0
    ) -> BackgroundProcess:
        patterns = tuple(WatchPattern.from_record(w) for w in rec.get("watch") or ())
        return self._make(
            self._placeholder_env(env),
            str(rec["id"]),
            str(rec.get("command", "")),
            driver,
            patterns=patterns,
            notify_on_exit=bool(rec.get("notify_on_exit", True)),
            pty=bool(rec.get("pty")),
            detached=bool(rec.get("detached")),
            started_at=rec.get("started_at"),
            start_offset=start_offset,
        )

    def _lost(self, env: BaseEnvironment | None, rec: dict[str, Any], why: str) -> BackgroundProcess:
        proc = self._adopted(env, rec, NotOursDriver(rec))
        proc._finish(None, status=ProcessStatus.LOST, note=why)
        return proc


def _kill_quietly(proc: BackgroundProcess) -> None:
    try:
        proc.kill()
    except Exception as exc:  # noqa: BLE001 - closing must go on for the others
        log.warning("hermes-env: could not kill background process %s: %s", proc.id, exc)
        proc._unfollow(f"could not be killed: {exc}")


def _remove_dirs(drivers: list[SandboxDriver]) -> None:
    for d in drivers:
        d.remove()


def _close_at_exit(ref: weakref.ref[ProcessRegistry]) -> None:
    reg = ref()
    if reg is not None:
        try:
            reg.close()
        except Exception as exc:  # noqa: BLE001 - interpreter shutdown: say it, do not raise
            log.warning("hermes-env: closing the process registry at exit failed: %s", exc)
