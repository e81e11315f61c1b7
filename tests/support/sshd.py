"""A real OpenSSH server on 127.0.0.1 for the test suite.

``SshServer`` starts Debian's ``/usr/sbin/sshd`` in the foreground with a
private config, host key and client key in a temporary directory, on a free
port, for a non-root test user (default ``hermes-test``)::

    with SshServer() as server:
        client = server.paramiko_client()          # key auth, host key pinned
        client.exec_command("true")

The binary itself is installed by ``scripts/ensure-sshd.sh``; the pytest
fixtures live in ``tests/support/ssh_fixtures.py``.

Needs root (it creates the user, writes its authorized_keys and runs sshd).
When sshd is missing, ``SshServer.start()`` raises ``SshdUnavailable``; in CI
(``CI=true``) callers must let that fail the test, elsewhere they may skip.

The test user is deliberately not root: root's shell start-up on this machine
runs pyenv (~100 ms a command). The user's ``~/.bashrc``, ``~/.profile`` and
``~/.bash_logout`` are kept equal to Debian's ``/etc/skel``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import pwd
import secrets
import shutil
import signal
import sys
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["SshServer", "SshdUnavailable", "sshd_available", "in_ci", "SSHD_PATH"]

SSHD_PATH = "/usr/sbin/sshd"
DEFAULT_USER = "hermes-test"

# Root-only state shared by every SshServer on the machine (and by parallel
# test workers): a lock around user/key edits and the user's password, so
# that two servers alive at once agree on it.
STATE_DIR = Path("/var/lib/hermes-env-tests")

SKEL_FILES = (".bashrc", ".profile", ".bash_logout")

# sshd runs under this small parent, a child subreaper (prctl
# PR_SET_CHILD_SUBREAPER): the user's commands orphaned by a killed session
# are reparented to it and reaped, instead of going to PID 1, which on some
# machines (this one included) never reaps and leaves "<defunct>" entries
# that pgrep and ps still list. It forwards TERM/INT/HUP to sshd and exits
# with sshd's status as soon as sshd exits.
_REAPER = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.stderr.write("reaper: prctl failed, orphans go to PID 1\n")
argv = sys.argv[1:]
child = os.fork()
if child == 0:
    try:
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
def forward(signum, frame):
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(signum, forward)
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        sys.exit(1)
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        # Reap what has already died, then leave (live orphans go to PID 1).
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        sys.exit(code if code >= 0 else 128 - code)
"""


class SshdUnavailable(RuntimeError):
    """OpenSSH's server (or ssh-keygen) is not installed, or we are not root."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def sshd_available(sshd_path: str = SSHD_PATH) -> bool:
    return os.access(sshd_path, os.X_OK) and shutil.which("ssh-keygen") is not None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _proc_table() -> dict[int, tuple[int, str, int, str]]:
    """pid -> (ppid, comm, uid, state) for every live process, from /proc."""
    table: dict[int, tuple[int, str, int, str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        # comm is in parentheses and may itself contain spaces or parentheses.
        lpar, rpar = stat.index("("), stat.rindex(")")
        comm = stat[lpar + 1 : rpar]
        fields = stat[rpar + 2 :].split()
        table[pid] = (int(fields[1]), comm, uid, fields[0])
    return table


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _descendants(root: int, table: dict[int, tuple[int, str, int, str]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _comm, _uid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def _listener_of(reaper_pid: int) -> int | None:
    for pid, (ppid, comm, _uid, state) in _proc_table().items():
        if ppid == reaper_pid and comm == "sshd" and state != "Z":
            return pid
    return None


def _alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (PID 1 here may not reap)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    remaining = [p for p in pids if _alive(p)]
    while remaining and time.monotonic() < deadline:
        time.sleep(0.01)
        remaining = [p for p in remaining if _alive(p)]
    return remaining


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class SshServer:
    """A private sshd on 127.0.0.1 for one non-root test user.

    Attributes after ``start()`` (or entering the ``with`` block):
    ``host``, ``port``, ``user``, ``password``, ``home``, ``uid``,
    ``client_key_path`` (ed25519 private key, OpenSSH format, no passphrase),
    ``client_public_key`` (its ``authorized_keys`` line), ``host_key_path``,
    ``host_public_key`` (a ``paramiko.Ed25519Key``, or None without paramiko),
    ``host_public_key_line``, ``known_hosts_path`` (an OpenSSH known_hosts
    file for ``[127.0.0.1]:port``), ``config_path``, ``log_path``, ``pid``.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        user: str = DEFAULT_USER,
        *,
        sshd_path: str = SSHD_PATH,
        port: int | None = None,
        start_timeout: float = 15.0,
        extra_config: dict[str, str] | None = None,
    ) -> None:
        self.user = user
        self.sshd_path = sshd_path
        self.port = port or 0
        self.start_timeout = start_timeout
        self.extra_config = dict(extra_config or {})
        self.password = ""
        self.home = Path("/home") / user
        self.uid = -1
        self.gid = -1
        self.tmpdir: Path | None = None
        self.client_key_path = Path()
        self.client_public_key = ""
        self.host_key_path = Path()
        self.host_public_key: Any = None
        self.host_public_key_line = ""
        self.known_hosts_path = Path()
        self.config_path = Path()
        self.log_path = Path()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> "SshServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> "SshServer":
        """Prepare user, keys and config (first time only) and start sshd."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        if not sshd_available(self.sshd_path):
            raise SshdUnavailable(
                f"{self.sshd_path} or ssh-keygen not found; run scripts/ensure-sshd.sh"
            )
        if os.geteuid() != 0:
            raise SshdUnavailable("SshServer needs root (creates a user, runs sshd)")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privsep dir
        first = self.tmpdir is None
        if first:
            self.tmpdir = Path(tempfile.mkdtemp(prefix="hermes-sshd-"))
            try:
                self._ensure_user()
                self._make_client_key()
                self._make_host_key()
                self._install_authorized_key()
            except BaseException:
                self.close()
                raise
        # A port picked by binding port 0 can be taken before sshd binds it;
        # on a first start, retry with a new port a few times.
        attempts = 3 if first and not self.port else 1
        for attempt in range(attempts):
            if not self.port or (first and attempt):
                self.port = _free_port(self.host)
            self._write_config()
            try:
                self._spawn()
                return self
            except RuntimeError as e:
                if attempt + 1 < attempts and "Address already in use" in str(e):
                    continue
                if first:
                    self.close()
                raise
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the listener and every session it spawned (keeps keys, port)."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        if proc.poll() is None:
            # Sessions call setsid() and outlive the listener: find them first.
            listener = _listener_of(proc.pid)
            sessions = [
                p for p in _descendants(proc.pid, _proc_table()) if p != listener
            ]
            self._kill_pids(sessions, signal.SIGKILL)
            _wait_gone(sessions, timeout)
            proc.terminate()  # the reaper forwards it to the listener
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
                if listener is not None:
                    self._kill_pids([listener], signal.SIGKILL)
        else:
            proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> None:
        """Stop and start again on the same port with the same keys."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop sshd, drop our authorized key, remove the temp dir (not the user)."""
        try:
            self.stop()
        finally:
            with contextlib.suppress(Exception):
                self._remove_authorized_key()
            if self.tmpdir is not None:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
                self.tmpdir = None

    @property
    def pid(self) -> int | None:
        """The pid of sshd's reaper parent; see ``listener_pid``."""
        return self._proc.pid if self._proc is not None else None

    @property
    def listener_pid(self) -> int | None:
        """The sshd listener's pid (a child of the reaper, ``pid``)."""
        return None if self._proc is None else _listener_of(self._proc.pid)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- test levers ---------------------------------------------------------

    def regenerate_host_key(self) -> None:
        """Replace the host key and restart on the same port ("host key changed")."""
        assert self.tmpdir is not None, "start() first"
        self.stop()
        for p in (self.host_key_path, self.host_key_path.with_suffix(".pub")):
            p.unlink(missing_ok=True)
        self._make_host_key()
        self.start()

    def session_pids(self) -> list[int]:
        """Per-connection sshd processes serving the test user (not the listener)."""
        if self._proc is None:
            return []
        table = _proc_table()
        prefix = f"sshd: {self.user}"
        out = []
        for pid in _descendants(self._proc.pid, table):
            ppid, comm, uid, state = table[pid]
            if comm != "sshd" or state == "Z":
                continue
            cmd = _cmdline(pid)
            # "sshd: USER [priv]" (root monitor), "sshd: USER@notty" (the
            # user's privsep child), "sshd: USER [net]"/"[preauth]" (pre-auth).
            if uid == self.uid or cmd == prefix or cmd.startswith(
                (prefix + " ", prefix + "@")
            ):
                out.append(pid)
        return sorted(out)

    def user_process_pids(self) -> list[int]:
        """Live non-sshd processes owned by the test user (its commands)."""
        return sorted(
            pid
            for pid, (_ppid, comm, uid, state) in _proc_table().items()
            if uid == self.uid and comm != "sshd" and state != "Z"
        )

    def kill_user_sessions(
        self, sig: int = signal.SIGKILL, *, timeout: float = 5.0
    ) -> list[int]:
        """Kill the sshd processes serving the test user's connections.

        The listener keeps running, so new connections work. The TCP
        connections drop without an SSH disconnect message, as when sshd's
        session dies mid-command. The user's commands themselves are not
        signalled (see ``user_process_pids``). Returns the pids killed.
        """
        pids = self.session_pids()
        self._kill_pids(pids, sig)
        if sig == signal.SIGKILL:
            left = _wait_gone(pids, timeout)
            if left:
                raise RuntimeError(f"sshd session processes survived SIGKILL: {left}")
        return pids

    # -- convenience for paramiko tests --------------------------------------

    def connect_kwargs(self, auth: str = "key") -> dict[str, Any]:
        """Keyword arguments for ``paramiko.SSHClient.connect``."""
        kw: dict[str, Any] = {
            "hostname": self.host,
            "port": self.port,
            "username": self.user,
            "allow_agent": False,
            "look_for_keys": False,
            "timeout": 10,
        }
        if auth == "key":
            kw["key_filename"] = str(self.client_key_path)
        elif auth == "password":
            kw["password"] = self.password
        else:
            raise ValueError(f"auth must be 'key' or 'password', not {auth!r}")
        return kw

    def paramiko_client(self, auth: str = "key", **overrides: Any) -> Any:
        """A connected ``paramiko.SSHClient`` that rejects any other host key."""
        import paramiko

        client = paramiko.SSHClient()
        client.load_host_keys(str(self.known_hosts_path))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.connect(**{**self.connect_kwargs(auth), **overrides})
        return client

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no sshd log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- internals -----------------------------------------------------------

    def _run(self, *argv: str, input: bytes | None = None) -> None:
        r = subprocess.run(argv, input=input, capture_output=True)
        if r.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:2])} failed ({r.returncode}): "
                f"{r.stderr.decode(errors='replace').strip()}"
            )

    def _ensure_user(self) -> None:
        with _state_lock():
            try:
                pw = pwd.getpwnam(self.user)
            except KeyError:
                self._run(
                    "useradd", "-m", "-d", str(self.home), "-s", "/bin/bash",
                    "-c", "hermes-env test user", self.user,
                )
                pw = pwd.getpwnam(self.user)
            if pw.pw_uid == 0:
                raise RuntimeError(f"test user {self.user!r} must not be root")
            self.uid, self.gid, self.home = pw.pw_uid, pw.pw_gid, Path(pw.pw_dir)
            if pw.pw_shell != "/bin/bash":
                self._run("usermod", "-s", "/bin/bash", self.user)
            # One password per machine, kept root-only, so that servers alive
            # at the same time (parallel workers) agree on it.
            pw_file = STATE_DIR / f"{self.user}.password"
            try:
                self.password = pw_file.read_text().strip()
            except OSError:
                self.password = ""
            if not self.password:
                self.password = secrets.token_urlsafe(18)
                fd = os.open(pw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self.password + "\n")
            # Also unlocks the account: sshd without PAM refuses locked ("!")
            # accounts, even for public-key logins.
            self._run("chpasswd", input=f"{self.user}:{self.password}\n".encode())
            self._ensure_home()

    def _ensure_home(self) -> None:
        home = self.home
        if not home.is_dir():
            home.mkdir(mode=0o750, parents=True)
        os.chown(home, self.uid, self.gid)
        # StrictModes: home must not be group/world writable.
        mode = home.stat().st_mode & 0o777
        if mode & 0o022:
            os.chmod(home, mode & ~0o022)
        for name in SKEL_FILES:
            skel, dest = Path("/etc/skel") / name, home / name
            if not skel.is_file():
                continue
            if not dest.is_file() or dest.read_bytes() != skel.read_bytes():
                shutil.copyfile(skel, dest)
                os.chown(dest, self.uid, self.gid)
                os.chmod(dest, 0o644)
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(ssh_dir, self.uid, self.gid)
        os.chmod(ssh_dir, 0o700)

    def _keygen(self, path: Path, comment: str) -> str:
        self._run(
            "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)
        )
        return path.with_name(path.name + ".pub").read_text().strip()

    def _make_client_key(self) -> None:
        assert self.tmpdir is not None
        self.client_key_path = self.tmpdir / "client_ed25519"
        self._key_tag = f"hermes-env-test-{secrets.token_hex(6)}"
        self.client_public_key = self._keygen(self.client_key_path, self._key_tag)

    def _make_host_key(self) -> None:
        assert self.tmpdir is not None
        self.host_key_path = self.tmpdir / "ssh_host_ed25519_key"
        self.host_public_key_line = self._keygen(self.host_key_path, "hermes-env-test-host")
        keytype, b64 = self.host_public_key_line.split()[:2]
        self.known_hosts_path = self.tmpdir / "known_hosts"
        # The port is not known yet on a first start; _write_config rewrites it.
        self._write_known_hosts()
        try:
            import paramiko
        except ImportError:
            self.host_public_key = None
        else:
            self.host_public_key = paramiko.PKey.from_type_string(
                keytype, base64.b64decode(b64)
            )

    def _write_known_hosts(self) -> None:
        if not self.host_public_key_line:
            return
        keytype, b64 = self.host_public_key_line.split()[:2]
        host = f"[{self.host}]:{self.port}" if self.port else self.host
        self.known_hosts_path.write_text(f"{host} {keytype} {b64}\n")

    def _install_authorized_key(self) -> None:
        path = self.home / ".ssh" / "authorized_keys"
        with _state_lock():
            existing = path.read_text() if path.exists() else ""
            lines = [ln for ln in existing.splitlines() if ln.strip()]
            lines.append(self.client_public_key)
            path.write_text("\n".join(lines) + "\n")
            os.chown(path, self.uid, self.gid)
            os.chmod(path, 0o600)

    def _remove_authorized_key(self) -> None:
        if not self.client_public_key:
            return
        path = self.home / ".ssh" / "authorized_keys"
        with _state_lock():
            if not path.exists():
                return
            lines = [
                ln for ln in path.read_text().splitlines()
                if ln.strip() and ln.strip() != self.client_public_key
            ]
            path.write_text("".join(ln + "\n" for ln in lines))

    def _write_config(self) -> None:
        assert self.tmpdir is not None
        self.config_path = self.tmpdir / "sshd_config"
        self.log_path = self.tmpdir / "sshd.log"
        options = {
            "ListenAddress": f"{self.host}:{self.port}",
            "HostKey": str(self.host_key_path),
            "PidFile": str(self.tmpdir / "sshd.pid"),
            # Without PAM, sshd checks /etc/shadow itself (Debian's build has
            # shadow support), so PasswordAuthentication works for the
            # chpasswd-set password, and no PAM session modules run.
            "UsePAM": "no",
            "PubkeyAuthentication": "yes",
            "PasswordAuthentication": "yes",
            "PermitEmptyPasswords": "no",
            "KbdInteractiveAuthentication": "no",
            "PermitRootLogin": "no",
            "AllowUsers": self.user,
            "AuthorizedKeysFile": ".ssh/authorized_keys",
            "StrictModes": "yes",
            "MaxSessions": "200",
            "MaxStartups": "100:30:200",
            "Subsystem": "sftp internal-sftp",
            "LogLevel": "VERBOSE",
            "UseDNS": "no",
            "PrintMotd": "no",
            "PrintLastLog": "no",
            "X11Forwarding": "no",
        }
        options.update(self.extra_config)
        self.config_path.write_text(
            "".join(f"{k} {v}\n" for k, v in options.items())
        )
        self._write_known_hosts()

    def _spawn(self) -> None:
        # Validate the config first: a clear error beats a dead child.
        check = subprocess.run(
            [self.sshd_path, "-t", "-f", str(self.config_path)],
            capture_output=True,
        )
        if check.returncode != 0:
            raise RuntimeError(
                "sshd -t rejected the config: "
                + check.stderr.decode(errors="replace").strip()
            )
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER,
             self.sshd_path, "-D", "-e", "-f", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=self._log_file,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.start_timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                with socket.create_connection((self.host, self.port), timeout=1) as s:
                    s.settimeout(max(0.1, deadline - time.monotonic()))
                    banner = b""
                    while b"\n" not in banner and len(banner) < 256:
                        chunk = s.recv(256)
                        if not chunk:
                            break
                        banner += chunk
                if banner.startswith(b"SSH-2.0"):
                    return
                last_error = RuntimeError(f"unexpected banner {banner!r}")
            except OSError as e:
                last_error = e
            time.sleep(0.01)
        rc = self._proc.poll()
        proc, self._proc = self._proc, None
        if rc is None:
            proc.kill()
        proc.wait()
        self._log_file.close()
        self._log_file = None
        state = f"exited with {rc}" if rc is not None else "no SSH banner in time"
        raise RuntimeError(
            f"sshd on {self.host}:{self.port} did not become ready ({state}; "
            f"last error: {last_error}). Log tail:\n{self.log_tail()}"
        )

    @staticmethod
    def _kill_pids(pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
