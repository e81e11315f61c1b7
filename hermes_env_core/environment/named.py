"""Named sessions: a session server that outlives the process that started it.

The server reads its script from a FIFO ``in`` and writes to a FIFO ``out``
in the session's private directory (both opened read-write, so it never sees
an end when a client leaves). A client reaches it through a small bash relay
in the target, opened as any stream (``_open_channel``): the relay holds the
session's lock (a directory, with its pid), starts the server and an idle
watchdog when there is none, and copies the stream to and from the FIFOs.
"""

from __future__ import annotations

import logging
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import EnvironmentUnavailable, HermesEnvError, UnsupportedOperation
from .channel import ChannelStream
from .named_store import SessionRecord, SessionStore, check_name, public_options
from .server import BOOT_ARGV, ServerLost, SessionServer
from .serverexec import ServerRunner, _Control
from .session import SessionState, ShellSession, parse_state_dump

if TYPE_CHECKING:
    from ..factory import EnvironmentFactory
    from .base import BaseEnvironment

__all__ = ["SessionBusyError", "SessionLostError", "open_session", "supports_named_sessions"]

_log = logging.getLogger(__name__)

#: The relay: reads ``dir TAB mode TAB wait TAB idle`` from its stream, says
#: ``\x1ehermes-relay new|attached|busy|lost|error ...``, then copies.
#: ``$1`` is the server's boot script (``BOOT_ARGV[2]``).
RELAY = r"""
IFS=$'\t' read -r d mode wait idle || exit 1
umask 077
say() { printf '\036hermes-relay %s\n' "$*"; }
stamp() { printf '%(%s)T\n' -1 >"$d/.named-activity" 2>/dev/null; }
held() { local h=; IFS= read -r h <"$d/.named-lock/pid" 2>/dev/null; [[ -z $h ]] || kill -0 "$h" 2>/dev/null; }
alive() {
  local p= s=
  [[ -f $d/.named-pid ]] && IFS= read -r p <"$d/.named-pid" && [[ -n $p ]] && kill -0 "$p" 2>/dev/null || return 1
  IFS= read -r s <"/proc/$p/stat" 2>/dev/null && s=${s##*) } && [[ ${s%% *} == Z ]] && return 1
  pid=$p
}
watch() {
  local last t step=1
  ((idle >= 20)) && step=5
  while kill -0 "$pid" 2>/dev/null; do
    sleep "$step"
    ((idle > 0)) || continue
    mkdir -- "$d/.named-lock" 2>/dev/null || continue
    last=0; IFS= read -r last <"$d/.named-activity" 2>/dev/null
    printf -v t '%(%s)T' -1
    if ((t - ${last:-0} >= idle)); then
      printf 'builtin exit 0\n' >&4
      for t in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -TERM "$pid" 2>/dev/null; sleep 0.5; kill -KILL "$pid" 2>/dev/null
      rm -rf -- "$d"; exit 0
    fi
    rmdir -- "$d/.named-lock" 2>/dev/null
  done
}
if [[ ! -d $d ]]; then
  [[ $mode == attach ]] && { say lost "its private directory $d is gone"; exit 0; }
  mkdir -m 700 -- "$d" 2>/dev/null || { say error "cannot make $d"; exit 0; }
fi
[[ -O $d && ! -L $d ]] || { say error "$d is not a directory of this user"; exit 0; }
while ! mkdir -- "$d/.named-lock" 2>/dev/null; do
  if ! held; then
    for f in reader writer; do r=; IFS= read -r r <"$d/.named-lock/$f" 2>/dev/null && [[ -n $r ]] && kill "$r" 2>/dev/null; done
    rm -rf -- "$d/.named-lock"; continue
  fi
  [[ $wait == 1 ]] || { h=; IFS= read -r h <"$d/.named-lock/pid" 2>/dev/null; say busy "${h:-?}"; exit 0; }
  [[ -d $d ]] || { say lost "the session ended while this attach waited"; exit 0; }
  sleep 0.05
done
printf '%s\n' "$$" >"$d/.named-lock/pid"
pid=
if ! alive; then
  if [[ $mode == attach ]]; then rm -rf -- "$d/.named-lock"; say lost "its session server ended"; exit 0; fi
  rm -f -- "$d/.named-in" "$d/.named-out" "$d/.named-pid"
  mkfifo -m 600 -- "$d/.named-in" "$d/.named-out" || { rm -rf -- "$d/.named-lock"; say error "mkfifo failed in $d"; exit 0; }
  set -m
  ( exec bash -c "$1" <>"$d/.named-in" 1<>"$d/.named-out" 2>&1 ) &
  pid=$!
  printf '%s\n' "$pid" >"$d/.named-pid"
  ( exec 4<>"$d/.named-in"; watch ) </dev/null >/dev/null 2>&1 &
  set +m
  stamp
  say new "$pid"
else
  stamp
  say attached "$pid"
fi
exec 6<&0
cat -- "$d/.named-out" & r=$!
{ cat <&6 >"$d/.named-in"; kill "$r"; } 2>/dev/null & w=$!
exec 6<&-
printf '%s\n' "$r" >"$d/.named-lock/reader"; printf '%s\n' "$w" >"$d/.named-lock/writer"
wait "$r"
kill "$w" 2>/dev/null
stamp
rm -rf -- "$d/.named-lock"
"""

RELAY_ARGV: tuple[str, ...] = ("bash", "-c", RELAY, "hermes-relay", BOOT_ARGV[2])
_STATUS = b"\x1ehermes-relay "
_RELEASE_AFTER_S = 0.2  # idle this long after a command, an attached environment lets another process in


class SessionBusyError(HermesEnvError):
    """Another process is attached to the named session (and waiting was not wanted)."""


class SessionLostError(EnvironmentUnavailable):
    """The named session's target or server is gone; its last checkpoint can be restored."""


def supports_named_sessions(cls: type) -> bool:
    """A backend declares named sessions with ``named_sessions = True`` (and offers a stream, ``_open_channel``)."""
    return bool(getattr(cls, "named_sessions", False))


class _RelayRefused(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind} {detail}")
        self.kind, self.detail = kind, detail


class NamedServer(SessionServer):
    """A session server reached through the relay: booted by it, or found running."""

    def __init__(
        self,
        opener: Callable[[Sequence[str]], ChannelStream],
        *,
        private_dir: str,
        login: bool,
        label: str,
        init: str,
        mode: str,
        wait: bool,
        idle: float | None,
    ) -> None:
        self._head = f"{private_dir}\t{mode}\t{1 if wait else 0}\t{int(idle or 0)}\n".encode()
        self._wait = wait
        self.attached = False
        super().__init__(
            lambda argv: opener(RELAY_ARGV), private_dir=private_dir, login=login, label=label, init=init
        )

    def _boot(self, login: bool, init: str) -> None:
        self._send(self._head)
        # Waiting for another client to let go has no limit but the caller's patience.
        deadline = time.monotonic() + (7 * 86400.0 if self._wait else 60.0)
        try:
            self._read_until(_STATUS, deadline, None)
            while b"\n" not in self._buf:
                data = self._next(max(deadline - time.monotonic(), 0.01))
                if data is not None:
                    self._buf += data
        except ServerLost:
            raise EnvironmentUnavailable(f"{self.label}: the session relay did not start (is bash there?)") from None
        line, _, self._buf = self._buf.partition(b"\n")
        kind, _, detail = line.decode(errors="replace").partition(" ")
        if kind == "new":
            super()._boot(login, init)
            return
        if kind != "attached":
            raise _RelayRefused(kind, detail)
        self.attached = True
        self.login_failed = None
        self.has_head, self.start_ticks = False, 0
        nonce = secrets.token_hex(12)
        # The same hello as a booting server says (SessionServer._boot), from the running one.
        self._send((
            "{ [[ -r /proc/$$/fd/255 ]] && command -v head >/dev/null && __hermes_h=head || __hermes_h=-; "
            "IFS= read -r __hermes_st </proc/$$/stat; __hermes_st=${__hermes_st##*) }; "
            f"builtin printf '\\036{nonce}:H%s %s %s %s\\n' \"$$\" \"$__hermes_h\" \"$__hermes_st\" \"$BASH_VERSION\"; "
            "builtin unset -v __hermes_h __hermes_st; } 2>/dev/null\n"
        ).encode())
        self._read_until(b"\x1e" + nonce.encode() + b":H", time.monotonic() + 60.0, None)
        while b"\n" not in self._buf:
            data = self._next(5.0)
            if data is not None:
                self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        pid, _, rest = line.decode(errors="replace").partition(" ")
        tool, _, rest = rest.partition(" ")
        fields = rest.split(" ")
        self.start_ticks = int(fields[19]) if len(fields) > 20 and fields[19].isdigit() else 0
        self.pid = int(pid) if pid.isdigit() else 0
        self.has_head = tool == "head"
        self.bash_version = " ".join(fields[50:]) if len(fields) > 50 else (fields[-1] if fields else "")

    def detach(self, timeout: float = 5.0) -> None:
        """Let go of the session, leaving the server running: the relay stops and frees the lock."""
        lock = shlex.quote(self.private_dir + "/.named-lock/reader")
        try:
            self._send(
                f"{{ IFS= builtin read -r __hermes_c <{lock} && builtin kill \"$__hermes_c\"; "
                "builtin unset -v __hermes_c; } 2>/dev/null\n".encode()
            )
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                self._buf = b""
                self._next(max(end - time.monotonic(), 0.01))
        except ServerLost:
            pass
        finally:
            self.close()

    def close(self) -> None:
        super().close()
        # Until the reader thread has seen its stream end, it may still read the stream's descriptor
        # number, which the next stream opened (the relay of a new server) may be given.
        if self._reader is not threading.current_thread():
            self._reader.join(2.0)

    def quit(self, timeout: float = 10.0) -> bytes:
        # Ending the session for good: its private directory goes with it, and the relay is told
        # to stop (background jobs may hold the output FIFO open, so it would not see the end).
        d = shlex.quote(self.private_dir)
        try:
            self._send(
                f"{{ IFS= builtin read -r __hermes_c <{d}/.named-lock/reader; command rm -rf -- {d}; "
                f'builtin kill "$__hermes_c"; }} 2>/dev/null; builtin exit 0\n'.encode()
            )
        except ServerLost:
            pass
        return super().quit(timeout)


class NamedRunner(ServerRunner):
    """A ``ServerRunner`` whose first server may be one found running (attached), not booted."""

    def __init__(self, *, binding: NamedBinding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.binding = binding
        self._first_mode: str | None = binding.mode
        self._preboot: NamedServer | None = None
        self._released = False  # let go of the server after a command; attach again for the next
        self._runs = 0
        self._timer: threading.Timer | None = None

    def run(self, command: str, **kwargs: Any) -> Any:
        self._runs += 1
        if self._timer is not None:
            self._timer.cancel()
        try:
            return super().run(command, **kwargs)
        finally:
            # Let go once idle a moment: commands in a row keep the attachment (an attach costs a stream).
            self._timer = threading.Timer(_RELEASE_AFTER_S, self._let_go, (self._runs,))
            self._timer.daemon = True
            self._timer.start()

    def _let_go(self, runs: int | None = None) -> None:
        """Between commands the session is free for another process (it waits for this one's command only)."""
        if not self._lock.acquire(timeout=5.0):
            return
        try:
            server = self._server
            if runs is not None and runs != self._runs:
                return  # another command came meanwhile
            if self._closed or self.binding.ending or not isinstance(server, NamedServer) or not server.alive:
                return
            if server.dirty:
                try:
                    self._refresh()
                except (ServerLost, TimeoutError, HermesEnvError) as exc:
                    _log.debug("%s: checkpoint before letting go failed: %r", self.label, exc)
            if server.alive:
                self.binding.persist(self.session, server.pid)
                self._server = None
                self._released = True
                server.detach()
        finally:
            self._lock.release()

    def _boot(self) -> SessionServer:
        if self._preboot is not None:
            server, self._preboot = self._preboot, None
            return server
        first, self._first_mode = self._first_mode, None
        try:
            return NamedServer(
                self._opener, private_dir=self.private_dir, login=self._login, label=self.label, init=self._init,
                mode=first or "create", wait=self.binding.wait if first else True, idle=self.binding.idle_timeout,
            )
        except _RelayRefused as exc:
            raise self.binding.refused(exc) from None

    def _ensure(self) -> SessionServer:
        server: SessionServer
        if self._server is None and self._released:
            self._released = False
            try:
                server = NamedServer(
                    self._opener, private_dir=self.private_dir, login=self._login, label=self.label, init=self._init,
                    mode="attach", wait=self.binding.wait, idle=self.binding.idle_timeout,
                )
            except _RelayRefused as exc:
                self._released = True
                raise self.binding.refused(exc) from None
            self._server = server
            self._cpu = None
            self._open_control()
            return server
        if self._server is not None or self.session.baseline is not None:
            return super()._ensure()
        found = self._boot()
        assert isinstance(found, NamedServer)
        if found.attached:
            server = found
            self._server = server
            dump, sep, cwd = found.checkpoint()
            baseline = self.binding.baseline
            state = parse_state_dump(dump, sep, self.session.excluded_prefixes, cwd or None, names_from=baseline)
            self.session.set_baseline(baseline or state)
            self.session.set_state(state)
            self._checkpoint_of = 0
            self._open_control()
            return server
        self._preboot = found
        server = super()._ensure()
        restore = self.binding.restore_state
        if restore is not None:
            self.binding.restore_state = None
            self.session.set_state(restore)
            self._restore(server, restore)
            self._note(f"session {self.binding.name!r}: its last checkpoint was restored into a new target")
        return server

    def _open_control(self) -> None:
        # As for a server booted here: opened while the target can start processes (see ServerRunner._ensure).
        if self._control is None:
            try:
                self._control = _Control(self._opener)
            except Exception as exc:  # noqa: BLE001 - opened again when needed
                _log.debug("%s: no control stream yet: %r", self.label, exc)

    def close(self) -> bytes:
        if self._timer is not None:
            self._timer.cancel()
        return super().close()

    def detach(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            with self._idle:
                self._idle.notify_all()
            server, self._server = self._server, None
            if isinstance(server, NamedServer) and server.alive:
                server.detach()
            elif server is not None:
                server.close()
            if self._control is not None:
                self._control.close()
                self._control = None


class NamedBinding:
    """What makes an environment a named session: its record, and how it attaches."""

    def __init__(
        self,
        store: SessionStore,
        record: SessionRecord,
        *,
        mode: str,
        wait: bool,
        restore_state: SessionState | None,
        baseline: SessionState | None,
    ) -> None:
        self.store = store
        self.record = record
        self.name = record.name
        self.mode = mode
        self.wait = wait
        self.idle_timeout = record.idle_timeout
        self.restore_state = restore_state
        self.baseline = baseline
        self.ending = False

    def make_runner(self, env: BaseEnvironment) -> NamedRunner:
        return NamedRunner(
            binding=self,
            label=f"{env.name} session {self.name!r}",
            opener=env._open_channel,
            private_dir=self.record.private_dir,
            login=env._server_login(),
            init=env._preamble(),
            default_cwd=env.config.cwd,
            excluded_prefixes=env.config.session_exclude_prefixes,
            env_id=env.task_id,
            note=env._note,
            explain_lost=env._explain_lost_since,
        )

    def refused(self, exc: _RelayRefused) -> HermesEnvError:
        if exc.kind == "busy":
            return SessionBusyError(
                f"session {self.name!r} is in use by another process (relay pid {exc.detail} in the target); "
                "wait for it (drop --no-wait / wait=False) or try again later"
            )
        if exc.kind == "lost":
            return self.lost(exc.detail)
        return EnvironmentUnavailable(f"session {self.name!r}: {exc.detail}")

    def lost(self, what: str) -> SessionLostError:
        _, state, saved, _ = self.store.get_state(self.name)
        idle = f" (or it ended after session_idle_timeout={self.idle_timeout:g}s idle)" if self.idle_timeout else ""
        offer = (
            f"its last checkpoint (saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(saved))}, cwd "
            f"{state.cwd}) can be restored into a new target: --restore, or create_environment(..., "
            f"session={self.name!r}, restore=True); or end it: hermes-env sessions rm {self.name}"
            if state is not None and saved is not None
            else f"no checkpoint was saved; end it with: hermes-env sessions rm {self.name}"
        )
        return SessionLostError(
            f"session {self.name!r} on {self.record.backend} ({self.record.target or '?'}) was lost: {what}{idle}; "
            + offer
        )

    def save(self, env: BaseEnvironment) -> None:
        runner = env._runner
        if not isinstance(runner, NamedRunner):
            return
        session = runner.session
        if runner._server is not None and runner._server.alive:
            try:
                session = runner.current_session()
            except HermesEnvError as exc:
                _log.debug("session %s: checkpoint not refreshed: %s", self.name, exc)
        self.persist(session, runner._server.pid if runner._server is not None else 0)

    def persist(self, session: ShellSession, server_pid: int) -> None:
        """Write the checkpoint and the record (after a command, and when detaching)."""
        if self.ending:
            return
        try:
            self.store.put_state(self.name, session.baseline, session.state)
            if server_pid:
                self.record.server_pid = server_pid
            self.record.last_used = time.time()
            self.store.put(self.record)
        except OSError as exc:
            _log.warning("session %s: its record could not be written: %s", self.name, exc)

    def detach(self, env: BaseEnvironment) -> None:
        if env.closed:
            return
        runner = env._runner
        if runner is not None and not (runner._server is not None and runner._server.alive):
            # The last command ended the shell (exit): its successor, with the state it handed back,
            # is what the next attach finds, as the next command here would have.
            try:
                with runner._lock:
                    runner._ensure()
            except HermesEnvError as exc:
                _log.debug("session %s: no new server before detaching: %s", self.name, exc)
        self.save(env)
        env._closed = True
        env._closing.set()
        try:
            if isinstance(env._runner, NamedRunner):
                env._runner.detach()
        finally:
            env.cleanup()

    def closing(self, env: BaseEnvironment) -> None:
        """``close()`` ends the session: attach first when nothing ran, so that its server is ended."""
        self.ending = True  # from here on the runner does not let go of its server (_let_go)
        try:
            # A let-go under way (its timer) ends first (the runner's lock); its server is attached again.
            env._server_runner().ensure_server()
        except HermesEnvError as exc:
            _log.debug("session %s: not reached at close: %s", self.name, exc)
        self.store.remove(self.name)
        cleanup = env.cleanup
        keeps = getattr(type(env), "background_options", None)
        if keeps:
            # The target was kept for the session (a persistent container): now it goes.
            env.cleanup = lambda: cleanup(force=True)  # type: ignore[method-assign,call-arg]


def _target_of(env: BaseEnvironment) -> str:
    for attr in ("container_id", "host_label"):
        value = getattr(env, attr, None)
        if value:
            return str(value)[:12] if attr == "container_id" else str(value)
    return socket.gethostname() if env.name == "local" else env.name


def open_session(
    factory: EnvironmentFactory,
    name: str,
    backend: str | None,
    options: dict[str, Any],
    *,
    option_strings: dict[str, str] | None = None,
    wait: bool = True,
    restore: bool = False,
    idle_timeout: float | None = None,
    store: SessionStore | None = None,
) -> BaseEnvironment:
    """Attach to the named session, or create it; see ``create_environment(session=...)``."""
    check_name(name)
    store = store or SessionStore()
    record = store.get(name)
    baseline: SessionState | None = None
    if record is None:
        if restore:
            store.require(name)  # says which names exist
        if backend is None:
            backend = factory.resolve(None, option_strings=option_strings, **options).backend
        mode = "create"
    else:
        if backend is not None and factory.registry.canonical(backend) != record.backend:
            raise HermesEnvError(
                f"session {name!r} lives on backend {record.backend!r}, not {backend!r}; "
                f"drop --env, or end it first: hermes-env sessions rm {name}"
            )
        backend = record.backend
        options = {**record.options, **options}
        option_strings = {**record.option_strings, **(option_strings or {})}
        mode = "attach"
        baseline, _, _, _ = store.get_state(name)
    cls = factory.registry.load(backend)
    if not supports_named_sessions(cls):
        raise UnsupportedOperation(
            f"backend {backend!r} does not support named sessions (it does not declare named_sessions); "
            "local, docker and ssh do"
        )
    keep = dict(getattr(cls, "background_options", None) or {})
    if record is None:
        task_id = options.get("task_id") or f"s-{name}-{secrets.token_hex(3)}"
        record = SessionRecord(
            name=name, backend=backend, options=public_options(options), task_id=str(task_id),
            private_dir=f"/tmp/hermes-env-{secrets.token_hex(16)}", idle_timeout=idle_timeout,
            option_strings={k: str(v) for k, v in public_options(dict(option_strings or {})).items()},
        )
    elif idle_timeout is not None:
        record.idle_timeout = idle_timeout
    binding = NamedBinding(store, record, mode=mode, wait=wait, restore_state=None, baseline=baseline)

    def restore_into_new() -> None:
        _, state, _, _ = store.get_state(name)
        if state is None:
            raise binding.lost("its target is gone and no checkpoint was saved")
        binding.mode, binding.baseline, binding.restore_state = "create", None, state

    resolved = factory.resolve(backend, option_strings=option_strings, **{**options, **keep, "task_id": record.task_id})
    exists = getattr(cls, "target_exists", None)
    if mode == "attach" and callable(exists) and keep and not exists(resolved.config):
        if not restore:
            raise binding.lost(f"its target {record.target or record.task_id} was removed")
        restore_into_new()
    env = factory.create_resolved(resolved)
    # The backend's word on a reused container says the shell starts fresh: not so here.
    env._notes[:] = [n for n in env._notes if not n.startswith("reusing persistent container")]
    env._named = binding
    try:
        try:
            runner = env._server_runner()
            with runner._lock:
                runner._ensure()
        except SessionLostError:
            if not restore:
                raise
            runner.close()
            env._runner = None
            restore_into_new()
            runner = env._server_runner()
            with runner._lock:
                runner._ensure()
    except BaseException:
        env._named = None
        env._closed = True
        env.cleanup()
        raise
    record.target = _target_of(env)
    binding.save(env)
    return env
