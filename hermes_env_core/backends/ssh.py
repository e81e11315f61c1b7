"""The ssh backend: commands run in bash on a remote host over one long-lived SSH connection.

paramiko is imported only when an environment is created (extra ``hermes-env-core[ssh]``).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shlex
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from pydantic import Field, SecretStr

from ..environment.base import BaseEnvironment
from ..environment.channel import ChannelStream
from ..environment.handles import ProcessHandle
from ..environment.options import EnvironmentConfig
from ..environment.session import KILL_TREE_FN, WrappedCommand
from ..errors import BackendError, ConfigError, EnvironmentUnavailable, UnsafeArchiveError
from ..sync import PullResult, SyncEngine, SyncJournal, SyncOption, SyncProgress
from ._tree_script import TREE_DONE, parse_tree_output, tree_script

if TYPE_CHECKING:
    import paramiko

    from ._ssh_sync import SSHSyncTransport

__all__ = [
    "DEFAULT_KNOWN_HOSTS",
    "SSHAuthenticationError",
    "SSHConfig",
    "SSHEnvironment",
    "SSHHostKeyError",
]

log = logging.getLogger(__name__)

#: hermes-env's own known_hosts file, so first contact never edits ~/.ssh
DEFAULT_KNOWN_HOSTS = "~/.config/hermes-env/known_hosts"
# sshd hands the command to the login shell as one argv string (128 KiB max);
# longer scripts are sent ahead of stdin on the channel instead.
_COMMAND_LIMIT = 100_000
_STDIN_INLINE = 65536  # below the server's initial window: sendall cannot block
_PID_MARK = b"\x1ehermes-pid:"
_PID_LINE = "command printf '\\036hermes-pid:%d\\n' $$; "
_PROBE_MARK = "\x1ehermes-probe\n"
# Home, whether the login shell is bash (then it runs our scripts itself), and
# a private state directory, on tmpfs when there is one (written every command).
_PROBE = (
    "d=; for b in /dev/shm /tmp; do [ -d $b ] && [ -w $b ] || continue; d=$b/hermes-env-{token}; "
    "mkdir -m 700 \"$d\" 2>/dev/null || [ -O \"$d\" ] && [ -d \"$d\" ] && [ ! -L \"$d\" ] && break; d=; done; "
    "command printf '\\036hermes-probe\\n%s\\n%s\\n%s\\n%s\\n' \"$HOME\" \"${{BASH_VERSION-}}\" \"${{SHELLOPTS-}}\" \"$d\""
)
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class SSHHostKeyError(EnvironmentUnavailable):
    """The server's host key is unknown (strict mode) or differs from the recorded one."""


class SSHAuthenticationError(EnvironmentUnavailable):
    """No configured credential was accepted."""


class SSHConfig(EnvironmentConfig):
    """Options of the ssh backend. ``host`` and ``user`` are required."""

    host: str = Field(..., min_length=1, description="The SSH server's name or address.")
    user: str = Field(..., min_length=1, description="The remote account to log in as.")
    port: int = Field(22, ge=1, le=65535, description="The SSH server's port.")
    key_path: str | None = Field(None, description="Private key file (unencrypted; use an agent otherwise).")
    password: SecretStr | None = Field(None, description="Password, tried after keys and the agent.")
    use_agent: bool = Field(True, description="Offer the keys of a running ssh-agent (SSH_AUTH_SOCK).")
    look_for_keys: bool = Field(True, description="Without key_path, try ~/.ssh/id_ed25519, id_ecdsa, id_rsa.")
    known_hosts: str = Field(DEFAULT_KNOWN_HOSTS, description="Where host keys are recorded and checked.")
    strict_host_key: bool = Field(False, description="Refuse hosts not already in known_hosts.")
    connect_timeout: float = Field(10.0, gt=0, description="Seconds to connect, authenticate or open a channel.")
    keepalive_s: float = Field(30.0, ge=0, description="Seconds between keepalives (0: off).")
    sync: tuple[SyncOption, ...] = Field(
        (), description="Host paths pushed before each command and pulled back at close (hermes_env_core.sync)."
    )
    sync_interval_s: float = Field(5.0, ge=0, description="Least time between two pushes (HERMES_ENV_FORCE_SYNC=1 skips it).")
    pull_on_close: bool = Field(True, description="Bring the target's changes to synced paths back at close.")


def _host_label(host: str, port: int) -> str:
    """How known_hosts names a server (OpenSSH's ``[host]:port`` unless port 22)."""
    return host if port == 22 else f"[{host}]:{port}"


class SSHEnvironment(BaseEnvironment):
    """Runs commands on a remote host; every command is a channel of one Transport."""

    name = "ssh"
    #: A detached background process needs nothing to outlive close: the host stays.
    background_options: dict[str, object] = {}
    stdin_mode = "pipe"
    # The remote bash's pid reaches us first thing on its channel, so the
    # wrapper need not write a pidfile (which a quick timeout could outrun,
    # leaving a previous command's pid there).
    records_pid = False
    state_dir_private = True  # made 0700 with a random name by the probe
    named_sessions = True  # a session server that outlives this process (environment.named)
    config_model = SSHConfig
    channel_startup_noise = True  # bash under sshd sources ~/.bashrc, which may print

    def __init__(self, config: SSHConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        cfg: SSHConfig = self.config  # type: ignore[assignment]
        for key in cfg.env:
            if not _NAME_RE.match(key):
                raise ConfigError(f"ssh: env key {key!r} is not a valid variable name")
        self._conn = _import_conn()
        self._label = _host_label(cfg.host, cfg.port)
        self._known_hosts = Path(cfg.known_hosts).expanduser()
        self._exports = "; ".join(f"builtin export {k}={shlex.quote(v)}" for k, v in cfg.env.items())
        self._lock = threading.Lock()
        self._transport: paramiko.Transport | None = None
        self._home = ""
        self._token = os.urandom(6).hex()
        self._remote_dir = ""
        self._bash_login = False  # the login shell is bash: no second bash needed
        self._orphans: list[int] = []  # remote pids of commands cut off by a lost connection
        #: progress callback for pushes (the CLI shows a bar); set before commands run
        self.sync_progress: Callable[[SyncProgress], None] | None = None
        self.last_pull: PullResult | None = None
        self._sync_engine: SyncEngine | None = None
        self._live()

    @classmethod
    def check_requirements(cls) -> list[str]:
        """What is missing on this machine for the ssh backend (empty when ready)."""
        try:
            import paramiko
        except ImportError:
            return ["paramiko is not installed: pip install 'hermes-env-core[ssh]'"]
        version = tuple(int(p) for p in re.findall(r"\d+", paramiko.__version__)[:2])
        if version < (3, 4):
            return [f"paramiko {paramiko.__version__} is too old (3.4 needed): pip install -U 'paramiko>=3.4'"]
        return []

    # -- connection --------------------------------------------------------
    @property
    def remote_home(self) -> str:
        """The remote account's home directory (``$HOME`` of its login shell)."""
        self._live()
        return self._home

    @property
    def host_label(self) -> str:
        """``user@host`` or ``user@[host]:port``, as in messages."""
        return f"{self._cfg.user}@{self._label}"

    @property
    def _cfg(self) -> SSHConfig:
        return self.config  # type: ignore[return-value]

    def _live(self) -> paramiko.Transport:
        """The connected Transport; reconnects when the last one dropped."""
        t = self._transport
        if t is not None and t.is_active():
            return t
        with self._lock:
            old = self._transport
            if old is not None and old.is_active():
                return old
            if self._closed:
                raise EnvironmentUnavailable(f"ssh environment {self.task_id!r} is closed")
            reason = None
            if old is not None:
                reason = old.get_exception()
                old.close()
            t = cast("paramiko.Transport", self._conn.connect(self.config, self._known_hosts))
            try:
                self._probe(t)
            except BaseException:
                t.close()
                raise
            self._transport = t
            if old is not None:
                why = f" ({type(reason).__name__}{f': {reason}' if str(reason) else ''})" if reason else ""
                self._note(f"ssh connection to {self.host_label} had dropped{why}; reconnected")
            orphans, self._orphans = self._orphans, []
        if orphans:
            self._stop_orphans(orphans)
        return t

    def _stop_orphans(self, pids: list[int]) -> None:
        # sshd does not signal a command whose connection died: it runs on. Stop
        # it, unless its pid now belongs to someone else (it must still lead
        # the session sshd gave it).
        script = KILL_TREE_FN + "".join(
            f"__hermes_s=; IFS= read -r __hermes_s </proc/{p}/stat 2>/dev/null && "
            f"set -- ${{__hermes_s##*) }} && [ \"$4\" = {p} ] && "
            f"{{ __hermes_kill_tree KILL {p}; builtin kill -KILL -- -{p} 2>/dev/null; }}\n"
            for p in pids
        ) + "exit 0\n"
        try:
            self._helper(script)
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("ssh: could not stop orphaned commands %s: %r", pids, exc)
            return
        self._note(f"stopped the command(s) the lost connection left running (remote pid {', '.join(map(str, pids))})")

    def _orphaned(self, pid: int | None) -> None:
        if pid is not None:
            with self._lock:
                self._orphans.append(pid)

    def _probe(self, t: paramiko.Transport) -> None:
        probe = _PROBE.format(token=self._token)
        code, out = self._conn.run_simple(t, probe, timeout=self._cfg.connect_timeout)
        text = out.decode("utf-8", "surrogateescape")
        if code != 0 or _PROBE_MARK not in text:
            raise EnvironmentUnavailable(
                f"ssh: {self.host_label} cannot run commands (exit {code}): {text.strip()[:500]!r}"
            )
        home, bash_version, shellopts, state_dir = (text.split(_PROBE_MARK, 1)[1].split("\n") + [""] * 4)[:4]
        if not state_dir:
            raise EnvironmentUnavailable(f"ssh: {self.host_label} has no writable /dev/shm or /tmp for session state")
        self._home, self._remote_dir = home, state_dir
        self._bash_login = bool(bash_version) and "posix" not in shellopts.split(":")

    def _drop(self, t: paramiko.Transport) -> None:
        with self._lock:
            if self._transport is t and not t.is_active():
                t.close()

    def _open(self, command: str, *, combine: bool = True) -> paramiko.Channel:
        """Open a channel and exec ``command`` in the login shell.

        A connection found dead before the exec request was sent is replaced
        and the command started on the new one; once sent, a loss is an error,
        since the command may have started.
        """
        timeout = self._cfg.connect_timeout
        for attempt in (0, 1):
            t = self._live()
            try:
                chan: paramiko.Channel = self._conn.open_channel(t, timeout)
            except self._conn.LOST_ERRORS as exc:
                if attempt == 0 and not t.is_active():
                    self._drop(t)
                    continue
                raise EnvironmentUnavailable(f"ssh: cannot open a channel to {self.host_label}: {exc}") from exc
            try:
                chan.set_combine_stderr(combine)
                chan.exec_command(command)
            except self._conn.LOST_ERRORS as exc:
                chan.close()
                if not t.is_active():
                    raise BackendError(
                        f"ssh: the connection to {self.host_label} was lost while starting the command: {exc!r}"
                    ) from exc
                raise EnvironmentUnavailable(f"ssh: {self.host_label} refused to run a command: {exc}") from exc
            return chan
        raise AssertionError("unreachable")

    def _in_bash(self, script: str, *, login: bool = False) -> str:
        """``script`` as a command for the login shell, run by bash."""
        if self._bash_login and not login:
            return script
        return f"exec bash {'-l ' if login else ''}-c {shlex.quote(script)} bash"

    def _helper(self, script: str) -> int:
        """Run a short bash script on the current connection (no reconnect)."""
        t = self._transport
        if t is None or not t.is_active():
            return -1
        code: int
        code, out = self._conn.run_simple(t, self._in_bash(script), timeout=self._cfg.connect_timeout)
        if code != 0:
            log.debug("ssh helper exited %s: %r", code, out[:200])
        return code

    def _helper_output(self, script: str) -> bytes | None:
        """Output of a short bash script on the current connection (None: no connection)."""
        t = self._transport
        if t is None or not t.is_active():
            return None
        out: bytes
        _, out = self._conn.run_simple(t, self._in_bash(script), timeout=self._cfg.connect_timeout)
        return out

    # -- what the base class asks for ----------------------------------------
    def _state_dir(self) -> str:
        self._live()
        cwd = self.config.cwd
        if cwd is not None and (cwd == "~" or cwd.startswith("~/")):
            # The session quotes its cwd, so "~" must be expanded here, before
            # the base class reads config.cwd for the new session.
            self.config = self.config.model_copy(update={"cwd": self._home + cwd[1:]})
        return self._remote_dir

    def _preamble(self) -> str:
        # Configured values travel in the private script, never on the command line.
        return self._exports

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        head = _PID_LINE
        command = head + self._in_bash(script, login=login)
        payload = stdin_data
        if len(command.encode("utf-8", "surrogateescape")) > _COMMAND_LIMIT:
            raw = script.encode("utf-8", "surrogateescape")
            stub = (
                f"LC_ALL=C IFS= builtin read -r -N {len(raw)} __hermes_script && "
                'builtin eval "builtin unset __hermes_script; $__hermes_script"'
            )
            command = head + self._in_bash(stub, login=login)
            payload = raw + (stdin_data or b"")
        elif payload is None:
            # No stdin: /dev/null, as for a local command, saves the EOF packet.
            command = "exec </dev/null; " + command
        chan = self._open(command)
        return _RemoteBash(self, chan, payload)

    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        # One session channel on the transport, held open; the server's stderr is not wanted.
        # Configured variables reach a session server through its stream (``_preamble``), never a command line.
        chan = self._open("exec " + shlex.join(argv) + " 2>/dev/null", combine=False)
        return _ChannelStream(chan)

    def _channel_orphaned(self, server_pid: int) -> None:
        # sshd leaves it running with its command: stopped like a command's bash
        # (now, or once reconnected).
        t = self._transport
        if t is not None and t.is_active():
            self._stop_orphans([server_pid])
        else:
            self._orphaned(server_pid)

    def _kill_tree(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        assert isinstance(handle, _RemoteBash)
        handle.signal_tree("TERM" if graceful else "KILL")

    def _tree_alive(self, handle: ProcessHandle, wrapped: WrappedCommand) -> bool | None:
        return handle.tree_alive() if isinstance(handle, _RemoteBash) else None

    # -- file sync -----------------------------------------------------------
    @property
    def sync_engine(self) -> SyncEngine | None:
        """The engine for the configured ``sync`` mappings (None without any)."""
        cfg: SSHConfig = self.config  # type: ignore[assignment]
        if self._sync_engine is None and cfg.sync:
            self._sync_engine = SyncEngine(
                self.sync_transport(),
                [m.mapping() for m in cfg.sync],
                interval=cfg.sync_interval_s,
                progress=lambda p: self.sync_progress(p) if self.sync_progress else None,
                journal=SyncJournal(f"ssh:{self.host_label}"),
            )
        return self._sync_engine

    def _before_execute(self) -> None:
        engine = self.sync_engine
        if engine is not None:
            engine.push()

    def pull_files(self) -> PullResult | None:
        """Apply the target's changes to the synced host paths (also done at close).

        Entries skipped as unsafe, and an archive refused as tampering (which
        raises ``UnsafeArchiveError``), are in ``last_pull`` and in a note on
        the next result.
        """
        engine = self.sync_engine
        if engine is None:
            return None
        try:
            self.last_pull = engine.pull()
        except UnsafeArchiveError as exc:
            if isinstance(exc.report, PullResult):
                self.last_pull = exc.report
                for note in exc.report.notes:
                    self._note(note)
            raise
        for note in self.last_pull.notes:
            self._note(note)
        return self.last_pull

    def cleanup(self) -> None:
        failed: BaseException | None = None
        if self._sync_engine is not None and self._transport is not None and self.config.pull_on_close:  # type: ignore[attr-defined]
            try:
                self.pull_files()
            except UnsafeArchiveError as exc:  # refused on purpose; last_pull has the report
                log.warning("ssh: %s", exc)
            except Exception as exc:  # noqa: BLE001 - raised once the connection is released
                failed = exc
        t = self._transport
        if t is not None and t.is_active() and self._remote_dir:
            try:
                self._helper(f"rm -rf -- {shlex.quote(self._remote_dir)}")
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("ssh: could not remove the remote state directory: %r", exc)
        with self._lock:
            t, self._transport = self._transport, None
        if t is not None:
            t.close()
        if failed is not None:
            # The engine kept what it knew (pushes refuse to overwrite the
            # target's changes); the caller must hear that they did not arrive.
            raise failed

    # -- for the sync engine --------------------------------------------------
    def sync_transport(self) -> SSHSyncTransport:
        """The ``FileSyncTransport`` that moves files over this environment's connection."""
        from ._ssh_sync import SSHSyncTransport

        return SSHSyncTransport(self)


class _Workers:
    """Reused daemon threads: starting a thread per command costs ~0.3 ms on a busy machine."""

    def __init__(self, idle_s: float = 60.0) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._idle_s = idle_s

    def submit(self, fn: Any, *args: Any) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._q.put((fn, args))
                return
        threading.Thread(target=self._loop, args=(fn, args), name="hermes-env-ssh", daemon=True).start()

    def _loop(self, fn: Any, args: tuple[Any, ...]) -> None:
        while True:
            try:
                fn(*args)
            except BaseException:
                log.exception("ssh worker task failed")
            with self._lock:
                self._idle += 1
            while True:
                try:
                    fn, args = self._q.get(timeout=self._idle_s)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._q.empty():
                            self._idle -= 1
                            return


_workers = _Workers()


def _import_conn() -> Any:
    try:
        from . import _ssh_conn
    except ImportError as exc:
        if exc.name != "paramiko" and not str(exc.name or "").startswith("paramiko."):
            raise
        raise EnvironmentUnavailable(
            "ssh: paramiko is not installed: pip install 'hermes-env-core[ssh]'"
        ) from exc
    return _ssh_conn


class _RemoteBash:
    """One remote bash as a ``ProcessHandle``.

    A thread moves the channel's output into a real pipe (the base class
    selects on a file descriptor; paramiko's ``Channel.fileno()`` only signals
    readiness) and picks the remote pid off the first line.
    """

    def __init__(self, env: SSHEnvironment, chan: paramiko.Channel, payload: bytes | None) -> None:
        r, w = os.pipe()
        self.stdout: IO[bytes] | None = os.fdopen(r, "rb", buffering=0)
        self.returncode: int | None = None
        self.error: BaseException | None = None
        self.pid: int | None = None
        self.seen: set[str] = set()  # pid:starttime of the command's processes, once signalled
        self._w = w
        self._env = env
        self._chan = chan
        self._pid_known = threading.Event()
        self._closed_by_us = False
        _workers.submit(self._pump)
        if payload is None:
            pass
        elif len(payload) <= _STDIN_INLINE:
            self._send(payload)
        else:
            _workers.submit(self._send, payload)

    def _send(self, payload: bytes) -> None:
        try:
            if payload:
                self._chan.sendall(payload)
            self._chan.shutdown_write()
        except (OSError, EOFError) as exc:  # the command ended without reading it all
            log.debug("ssh: stdin not fully sent: %r", exc)
        except Exception as exc:  # noqa: BLE001 - paramiko.SSHException
            log.debug("ssh: stdin not fully sent: %r", exc)

    def _pump(self) -> None:
        chan, w = self._chan, self._w
        head = b""
        passing = False
        try:
            while True:
                try:
                    data = chan.recv(65536)
                except Exception as exc:  # noqa: BLE001 - surfaced by wait()
                    self.error = exc
                    break
                if not data:
                    break
                if not passing:
                    head += data
                    data, passing = self._take_pid(head)
                    if not passing:
                        continue
                    head = b""
                if w >= 0 and not _write_all(w, data):
                    os.close(w)  # the reader is gone; keep draining the channel
                    w = -1
        finally:
            if head and w >= 0:
                _write_all(w, head)  # no pid line: show whatever the shell said
            if w >= 0:
                os.close(w)
            self._pid_known.set()

    def _take_pid(self, head: bytes) -> tuple[bytes, bool]:
        i = head.find(_PID_MARK)
        if i < 0:
            return b"", len(head) > 65536  # give up looking; pass through
        j = head.find(b"\n", i)
        if j < 0:
            return b"", False
        try:
            self.pid = int(head[i + len(_PID_MARK) : j])
        except ValueError:
            pass
        self._pid_known.set()
        # Anything before the line came from the login shell's start-up files.
        return head[j + 1 :], True

    def _status(self) -> int:
        chan = self._chan
        sig: int | None = getattr(chan, "hermes_signal", None)
        if sig:
            return -sig
        if chan.exit_status >= 0:
            return chan.exit_status
        if self._closed_by_us:
            return -signal.SIGKILL
        t = chan.get_transport()
        where = self._env.host_label
        if t is not None and t.is_active():
            self.error = BackendError(f"ssh: {where} ended the command without an exit status")
        else:
            exc = t.get_exception() if t is not None else None
            self.error = BackendError(
                f"ssh: the connection to {where} was lost while the command was running"
                f" ({type(exc).__name__ if exc else 'closed'}); it is stopped on reconnect"
            )
            self._env._orphaned(self.pid)
        return -1

    def poll(self) -> int | None:
        if self.returncode is None and self._chan.status_event.is_set():
            self.returncode = self._status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._chan.status_event.wait(timeout):
            raise TimeoutError("remote command still running")
        code = self.poll()
        assert code is not None
        # Background children may keep the channel open; bash has exited.
        self._chan.close()
        if self.error is not None and not self._closed_by_us:
            if isinstance(self.error, BackendError):
                raise self.error
            raise BackendError(f"ssh: lost the command's output: {self.error!r}") from self.error
        return code

    def tree_alive(self) -> bool | None:
        """Whether any process of the command still runs (None: cannot tell)."""
        try:
            found = self._tree_helper("0")
        except Exception as exc:  # noqa: BLE001 - cannot tell: the caller sends SIGKILL
            log.debug("ssh: tree check failed: %r", exc)
            return None
        return None if found is None else bool(found)

    def _tree_helper(self, sig: str) -> set[str] | None:
        if self.pid is None:
            self._pid_known.wait(2.0)
        if self.pid is None:
            return None
        # sshd made the bash a session and group leader; the group catches
        # children whose parent already exited, the walk those that setsid,
        # and the processes seen by an earlier signal those re-parented since.
        script = tree_script(sig, self.pid, known=self.seen)
        out = self._env._helper_output(script)
        if out is None or TREE_DONE.encode() not in out:
            return None
        found = parse_tree_output(out)
        self.seen |= found
        return found

    def signal_tree(self, sig: str) -> None:
        """Signal the remote bash, its descendants and its process group."""
        try:
            if self._tree_helper(sig) is not None:
                return
        except Exception as exc:  # noqa: BLE001 - fall back to closing the channel
            log.debug("ssh: kill helper failed: %r", exc)
        if sig == "KILL":
            self._closed_by_us = True
            self._chan.close()

    def terminate(self) -> None:
        self.signal_tree("TERM")

    def kill(self) -> None:
        self.signal_tree("KILL")


class _ChannelStream:
    """A paramiko session channel as a resident channel's stream.

    Ends when the channel does, or when sshd reports the server's exit while
    a command's relay still holds its stdout open.
    """

    _CHECK_S = 0.2

    def __init__(self, chan: paramiko.Channel) -> None:
        self._chan = chan
        # Never select() on the channel: its fileno() makes a pipe that the
        # transport thread writes to as data arrives, and a write racing
        # close() gets EBADF, which kills the whole Transport (and with it the
        # pull-back at close). A timed recv waits on a condition instead.
        chan.settimeout(self._CHECK_S)

    def read(self, n: int) -> bytes:
        chan = self._chan
        try:
            while True:
                try:
                    return chan.recv(n)
                except TimeoutError:
                    if chan.exit_status_ready() or chan.closed:
                        return b""
        except Exception:  # noqa: BLE001 - the transport died
            return b""

    def write(self, data: bytes) -> None:
        try:
            self._chan.sendall(data)
        except OSError:
            raise
        except Exception as exc:  # paramiko.SSHException: the channel or connection is gone
            raise OSError(str(exc)) from exc

    def close(self) -> None:
        try:
            self._chan.close()
        except Exception:  # noqa: BLE001 - already gone
            pass


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BrokenPipeError:
            return False
        view = view[n:]
    return True
