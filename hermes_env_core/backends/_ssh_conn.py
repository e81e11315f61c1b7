"""paramiko plumbing for the ssh backend: one tuned Transport, host keys, non-interactive auth.

Imported only when an SSH environment connects, so the core imports without paramiko.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import paramiko
from paramiko.common import MSG_CHANNEL_REQUEST

from ..errors import EnvironmentUnavailable
from .ssh import SSHAuthenticationError, SSHHostKeyError
from .ssh import _host_label as host_label

if TYPE_CHECKING:
    from .ssh import SSHConfig

__all__ = ["LOST_ERRORS", "Transport", "connect", "host_label", "open_channel", "run_simple"]

#: what paramiko raises when the connection under a channel is gone
LOST_ERRORS: tuple[type[BaseException], ...] = (paramiko.SSHException, EOFError, OSError)

_DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")


def _channel_request(chan: paramiko.Channel, m: paramiko.Message) -> None:
    # paramiko ignores "exit-signal", so a command killed by a signal would
    # look like a lost connection (status -1). Keep the signal on the channel.
    pos = m.packet.tell()
    if m.get_text() == "exit-signal":
        m.get_boolean()
        name = m.get_text()
        try:
            num = signal.Signals["SIG" + name].value
        except KeyError:
            num = signal.SIGKILL.value
        chan.hermes_signal = num  # type: ignore[attr-defined]
        chan.status_event.set()
        return
    m.packet.seek(pos)
    paramiko.Channel._handle_request(chan, m)  # type: ignore[attr-defined]  # paramiko's own dispatcher


class Transport(paramiko.Transport):
    """A paramiko Transport that also understands ``exit-signal``."""

    _channel_handler_table: ClassVar[dict[int, Any]] = {
        **paramiko.Transport._channel_handler_table,  # type: ignore[attr-defined]
        MSG_CHANNEL_REQUEST: _channel_request,
    }


def _tune(sock: socket.socket, keepalive_s: float) -> None:
    # Without TCP_NODELAY each new channel waits ~40 ms for a delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if keepalive_s > 0 and hasattr(socket, "TCP_KEEPIDLE"):
        idle = max(1, int(keepalive_s))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, idle // 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def connect(cfg: SSHConfig, known_hosts: Path) -> Transport:
    """An authenticated Transport to ``cfg.host``, its host key checked against ``known_hosts``."""
    label = host_label(cfg.host, cfg.port)
    try:
        sock = socket.create_connection((cfg.host, cfg.port), timeout=cfg.connect_timeout)
    except OSError as exc:
        raise EnvironmentUnavailable(f"ssh: cannot connect to {cfg.host} port {cfg.port}: {exc}") from exc
    _tune(sock, cfg.keepalive_s)
    transport = Transport(sock)
    try:
        recorded = _recorded_keys(known_hosts, label)
        if recorded:
            # Ask for the key type we know, as OpenSSH does, so a server with
            # several host keys is not mistaken for a changed one.
            opts = transport.get_security_options()
            wanted = [t for t in opts.key_types if _key_family(t) in recorded]
            opts.key_types = wanted + [t for t in opts.key_types if t not in wanted]
        try:
            transport.start_client(timeout=cfg.connect_timeout)
        except LOST_ERRORS as exc:
            raise EnvironmentUnavailable(f"ssh: SSH handshake with {label} failed: {exc}") from exc
        _check_host_key(transport.get_remote_server_key(), label, known_hosts, recorded, cfg.strict_host_key)
        _authenticate(transport, cfg, label)
        if cfg.keepalive_s > 0:
            transport.set_keepalive(max(1, int(cfg.keepalive_s)))
        sock.settimeout(None)
        return transport
    except BaseException:
        transport.close()
        raise


def _key_family(key_type: str) -> str:
    return "ssh-rsa" if key_type.startswith("rsa-sha2-") else key_type


def _recorded_keys(path: Path, label: str) -> dict[str, paramiko.PKey]:
    keys = paramiko.HostKeys()
    if path.is_file():
        try:
            keys.load(str(path))
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise SSHHostKeyError(f"ssh: cannot read known_hosts file {path}: {exc}") from exc
    found = keys.lookup(label)
    return dict(found) if found is not None else {}


def _check_host_key(
    key: paramiko.PKey, label: str, path: Path, recorded: dict[str, paramiko.PKey], strict: bool
) -> None:
    offered = f"{key.get_name()} key {key.fingerprint}"
    if recorded:
        known = recorded.get(key.get_name())
        if known is None or known.asbytes() != key.asbytes():
            was = ", ".join(f"{k.get_name()} {k.fingerprint}" for k in recorded.values())
            raise SSHHostKeyError(
                f"ssh: the host key of {label} has changed: it offered the {offered}, but {path} "
                f"records {was}. This may be an attack; if the server was really reinstalled, "
                f"delete the lines for {label} from {path}."
            )
        return
    if strict:
        raise SSHHostKeyError(
            f"ssh: {label} is not in {path} and strict_host_key is on; it offered the {offered}. "
            f"Add it (ssh-keyscan -p PORT HOST >> {path}) or turn strict_host_key off."
        )
    _record(path, label, key)


def _record(path: Path, label: str, key: paramiko.PKey) -> None:
    """Append the key under a lock, unless another process recorded one meanwhile."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:
        raise SSHHostKeyError(f"ssh: cannot record the host key of {label} in {path}: {exc}") from exc
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if _recorded_keys(path, label).get(key.get_name()) is None:
            f.write(f"{label} {key.get_name()} {key.get_base64()}\n")


def _authenticate(transport: Transport, cfg: SSHConfig, label: str) -> None:
    """Key file, agent, default keys, then password; never a prompt."""
    who = f"{cfg.user}@{label}"
    tried: list[str] = []

    def try_key(key: paramiko.PKey, what: str) -> bool:
        tried.append(what)
        try:
            transport.auth_publickey(cfg.user, key)
        except paramiko.BadAuthenticationType as exc:
            if "publickey" not in exc.allowed_types:
                return False
        except paramiko.AuthenticationException:
            return False
        return transport.is_authenticated()

    if cfg.key_path:
        path = Path(cfg.key_path).expanduser()
        if try_key(_load_key(path, must=True), f"key {path}"):  # type: ignore[arg-type]
            return
    if cfg.use_agent and os.environ.get("SSH_AUTH_SOCK"):
        agent = paramiko.Agent()
        try:
            for key in agent.get_keys():
                if try_key(key, f"agent key {key.fingerprint}"):
                    return
        finally:
            agent.close()
    if cfg.look_for_keys and not cfg.key_path:
        for name in _DEFAULT_KEYS:
            found = _load_key(Path.home() / ".ssh" / name, must=False)
            if found is not None and try_key(found, f"key ~/.ssh/{name}"):
                return
    if cfg.password is not None:
        tried.append("password")
        try:
            transport.auth_password(cfg.user, cfg.password.get_secret_value())
        except paramiko.AuthenticationException:
            pass
        if transport.is_authenticated():
            return
    if not tried:
        raise SSHAuthenticationError(
            f"ssh: no way to log in as {who}: set key_path or password, or run an ssh-agent (use_agent)"
        )
    raise SSHAuthenticationError(f"ssh: {who} refused every configured credential (tried {', '.join(tried)})")


def _load_key(path: Path, *, must: bool) -> paramiko.PKey | None:
    if not must and not path.is_file():
        return None
    try:
        return paramiko.PKey.from_path(str(path))
    except (paramiko.PasswordRequiredException, TypeError) as exc:
        # cryptography raises TypeError for a passphrase-protected OpenSSH key.
        if isinstance(exc, TypeError) and "password" not in str(exc).lower():
            raise
        if not must:
            return None
        raise SSHAuthenticationError(
            f"ssh: key {path} is encrypted; load it into an ssh-agent (use_agent) - hermes-env never prompts"
        ) from exc
    except (OSError, paramiko.SSHException, ValueError) as exc:
        if not must:
            return None
        raise SSHAuthenticationError(f"ssh: cannot load key {path}: {exc}") from exc


def open_channel(transport: Transport, timeout: float) -> paramiko.Channel:
    """A new session channel; waits while the server is at its MaxSessions limit."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        try:
            return transport.open_session(timeout=max(deadline - time.monotonic(), 0.1))
        except paramiko.SSHException:
            # A refusal (MaxSessions) is a ChannelException, or a bare "Unable
            # to open channel" when a concurrent opener took the saved one.
            if not transport.is_active() or time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)  # retry as other channels close
            pause = min(pause * 2, 0.1)


def run_simple(transport: Transport, command: str, *, timeout: float) -> tuple[int, bytes]:
    """Run a short helper command; its exit status and merged output."""
    chan = open_channel(transport, timeout)
    try:
        chan.set_combine_stderr(True)
        chan.settimeout(timeout)
        chan.exec_command(command)
        chan.shutdown_write()
        out = bytearray()
        while True:
            data = chan.recv(65536)
            if not data:
                break
            out += data
        if not chan.status_event.wait(timeout):
            raise TimeoutError(f"ssh helper command did not finish in {timeout:g}s")
        sig = getattr(chan, "hermes_signal", None)
        return (-sig if sig else chan.exit_status), bytes(out)
    finally:
        chan.close()
