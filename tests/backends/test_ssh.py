"""The ssh backend against a real OpenSSH server on 127.0.0.1: the conformance suite plus
what only SSH has (auth, host keys, lost connections, the remote process tree)."""

from __future__ import annotations

import glob
import io
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from hermes_env_core.backends.ssh import (
    SSHAuthenticationError,
    SSHConfig,
    SSHEnvironment,
    SSHHostKeyError,
)
from hermes_env_core.errors import BackendError
from hermes_env_core.testing import EnvironmentConformance, wait_until

pytestmark = pytest.mark.ssh


def _clean_shared_tmp(server) -> None:
    """Remove the conformance suite's scratch files in /tmp that the test user owns.

    Only the test user's: /tmp is this host's, shared with every other test of the run
    and with a lane running beside this one (the local backend's and the Modal and
    Daytona emulators' sandboxes are host processes writing the same
    ``/tmp/hermes_t_*`` names). Sweeping them all once removed a file the other
    lane's command had just written.
    """
    for path in glob.glob("/tmp/hermes_t_*"):
        try:
            st = os.lstat(path)
            if st.st_uid != server.uid:
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass


def _make(server, tmp_path: Path, **options) -> SSHEnvironment:
    kw: dict[str, object] = {
        "host": server.host,
        "port": server.port,
        "user": server.user,
        "key_path": str(server.client_key_path),
        "use_agent": False,
        "look_for_keys": False,
        "known_hosts": str(tmp_path / "known_hosts"),
        "timeout": 60,
    }
    kw.update(options)
    return SSHEnvironment(**kw)


def _user_procs(server, pattern: str) -> list[str]:
    """Live processes of the test user whose command line starts with ``pattern``."""
    r = subprocess.run(["pgrep", "-u", server.user, "-f", "^" + pattern], capture_output=True, text=True, check=False)
    pids = r.stdout.split()
    live = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    live.append(pid)
        except OSError:
            pass
    return live


def _kill_user_procs(server, pattern: str) -> None:
    subprocess.run(["pkill", "-KILL", "-u", server.user, "-f", "^" + pattern], capture_output=True, check=False)


class TestSSHConformance(EnvironmentConformance):
    """Through the resident shell channel (the default)."""

    hypothesis_examples = 25

    @pytest.fixture
    def environment(self, sshd_server, tmp_path):
        _clean_shared_tmp(sshd_server)
        with _make(sshd_server, tmp_path, channel=True) as env:
            yield env
            assert env.channel_mode == "channel"
        _clean_shared_tmp(sshd_server)


class TestSSHProcessConformance(EnvironmentConformance):
    """One exec per command (the fallback path)."""

    hypothesis_examples = 25

    @pytest.fixture
    def environment(self, sshd_server, tmp_path):
        _clean_shared_tmp(sshd_server)
        with _make(sshd_server, tmp_path, channel=False) as env:
            yield env
        _clean_shared_tmp(sshd_server)


def test_scratch_cleanup_leaves_files_of_other_users_alone(sshd_server, tmp_path):
    # A root-owned scratch file stands for one of a lane running beside this one.
    other = Path(f"/tmp/hermes_t_other_{secrets.token_hex(6)}")
    other.write_text("the other lane's\n")
    try:
        with _make(sshd_server, tmp_path) as env:
            mine = env.execute(
                "f=/tmp/hermes_t_mine_$RANDOM$RANDOM; echo mine >$f; mkdir $f.d; echo $f"
            ).output.strip()
        assert os.lstat(mine).st_uid == sshd_server.uid
        _clean_shared_tmp(sshd_server)
        assert other.read_text() == "the other lane's\n"
        assert not os.path.lexists(mine) and not os.path.lexists(mine + ".d")
    finally:
        other.unlink(missing_ok=True)


# -- configuration -------------------------------------------------------------


def test_host_and_user_are_required_and_named():
    with pytest.raises(ValidationError) as e:
        SSHConfig(user="u")
    assert "host" in str(e.value)
    with pytest.raises(ValidationError) as e:
        SSHConfig(host="h")
    assert "user" in str(e.value)
    with pytest.raises(ValidationError) as e:
        SSHConfig(host="h", user="u", hostname="x")
    assert "hostname" in str(e.value)


def test_config_defaults():
    cfg = SSHConfig(host="h", user="u")
    assert cfg.port == 22 and cfg.strict_host_key is False
    assert cfg.known_hosts == "~/.config/hermes-env/known_hosts"
    assert "secret" not in repr(SSHConfig(host="h", user="u", password="secret"))


def test_module_imports_without_paramiko():
    code = (
        "import sys; sys.modules['paramiko'] = None\n"
        "import hermes_env_core.backends.ssh as m\n"
        "assert m.SSHEnvironment.check_requirements() == "
        "[\"paramiko is not installed: pip install 'hermes-env-core[ssh]'\"], m.SSHEnvironment.check_requirements()\n"
        "try:\n    m.SSHEnvironment(host='h', user='u')\n"
        "except m.EnvironmentUnavailable as e:\n    assert 'hermes-env-core[ssh]' in str(e)\n"
        "else:\n    raise SystemExit('no error')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, "-c", "import hermes_env_core.backends.ssh, sys; assert 'paramiko' not in sys.modules"],
        capture_output=True, text=True, check=False,
    )
    assert r.returncode == 0, r.stderr


def test_check_requirements_ready_here():
    assert SSHEnvironment.check_requirements() == []


# -- authentication ---------------------------------------------------------------


def test_key_auth(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path) as env:
        assert env.execute("id -un").output == f"{sshd_server.user}\n"


def test_password_auth(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path, key_path=None, password=sshd_server.password) as env:
        assert env.execute("id -un").output == f"{sshd_server.user}\n"


def test_agent_not_required(sshd_server, tmp_path, monkeypatch):
    monkeypatch.setenv("SSH_AUTH_SOCK", str(tmp_path / "no-agent.sock"))
    with _make(sshd_server, tmp_path, use_agent=True) as env:
        assert env.execute("echo ok").output == "ok\n"
    monkeypatch.delenv("SSH_AUTH_SOCK")
    with _make(sshd_server, tmp_path, use_agent=True) as env:
        assert env.execute("echo ok").output == "ok\n"


def test_wrong_password_is_an_error_not_a_prompt(sshd_server, tmp_path):
    with pytest.raises(SSHAuthenticationError) as e:
        _make(sshd_server, tmp_path, key_path=None, password="wrong")
    assert f"{sshd_server.user}@[127.0.0.1]:{sshd_server.port}" in str(e.value)
    assert "password" in str(e.value)


def test_no_credentials_configured(sshd_server, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with pytest.raises(SSHAuthenticationError, match="key_path or password"):
        _make(sshd_server, tmp_path, key_path=None)


def test_encrypted_key_refused_without_prompt(sshd_server, tmp_path):
    key = tmp_path / "enc_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "pass phrase", "-f", str(key)], check=True)
    with pytest.raises(SSHAuthenticationError, match="encrypted"):
        _make(sshd_server, tmp_path, key_path=str(key))


# -- host keys --------------------------------------------------------------------


def test_unknown_host_recorded_then_accepted(sshd_server, tmp_path):
    kh = tmp_path / "deep" / "dir" / "known_hosts"
    with _make(sshd_server, tmp_path, known_hosts=str(kh)) as env:
        env.execute("true")
    keytype, b64 = sshd_server.host_public_key_line.split()[:2]
    assert kh.read_text() == f"[127.0.0.1]:{sshd_server.port} {keytype} {b64}\n"
    assert stat.S_IMODE(kh.stat().st_mode) == 0o600
    with _make(sshd_server, tmp_path, known_hosts=str(kh), strict_host_key=True) as env:
        assert env.execute("echo again").output == "again\n"
    assert len(kh.read_text().splitlines()) == 1  # not recorded twice


def test_strict_mode_refuses_unknown_host(sshd_server, tmp_path):
    kh = tmp_path / "known_hosts"
    with pytest.raises(SSHHostKeyError) as e:
        _make(sshd_server, tmp_path, known_hosts=str(kh), strict_host_key=True)
    msg = str(e.value)
    assert f"[127.0.0.1]:{sshd_server.port}" in msg and str(kh) in msg
    assert not kh.exists()


def test_strict_mode_accepts_openssh_known_hosts(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path, known_hosts=str(sshd_server.known_hosts_path), strict_host_key=True) as env:
        assert env.execute("echo ok").output == "ok\n"


def test_changed_host_key_refused_naming_host_and_file(private_sshd_server, tmp_path):
    server = private_sshd_server
    kh = tmp_path / "known_hosts"
    env = _make(server, tmp_path, known_hosts=str(kh))
    try:
        env.execute("true")
        before = kh.read_text()
        server.regenerate_host_key()  # restarts sshd: the old connection is gone
        with pytest.raises(SSHHostKeyError) as e:
            env.execute("true")
        msg = str(e.value)
        assert f"[127.0.0.1]:{server.port}" in msg and str(kh) in msg and "changed" in msg
        with pytest.raises(SSHHostKeyError):
            _make(server, tmp_path, known_hosts=str(kh))
        assert kh.read_text() == before  # the new key was not recorded
    finally:
        env.close()


# -- the connection ----------------------------------------------------------------


def test_session_killed_mid_command_is_backend_error_then_reconnects(private_sshd_server, tmp_path):
    server = private_sshd_server
    with _make(server, tmp_path) as env:
        env.execute("export HERMES_T_KEEP=kept; cd /tmp")
        started = threading.Event()
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                outcome["result"] = env.execute(
                    "echo started; sleep 31.5; echo finished",
                    on_output=lambda text: started.set() if "started" in text else None,
                )
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        try:
            assert started.wait(10)
            assert server.kill_user_sessions()
            t.join(10)
            assert not t.is_alive()
            assert isinstance(outcome.get("error"), BackendError), outcome
            assert "lost" in str(outcome["error"])
            if env.channel_mode != "channel":  # a channel's server stops it itself on the drop
                assert _user_procs(server, "sleep 31.5")  # sshd left the command running
            r = env.execute('echo "$HERMES_T_KEEP"; pwd')
            assert r.output == "kept\n/tmp\n" and r.exit_code == 0
            assert any("reconnected" in n for n in r.notes)
            assert any("stopped" in n for n in r.notes)
            assert wait_until(lambda: not _user_procs(server, "sleep 31.5"), 10)
        finally:
            _kill_user_procs(server, "sleep 31.5")


def test_transport_dropped_between_commands_reconnects(private_sshd_server, tmp_path):
    server = private_sshd_server
    with _make(server, tmp_path) as env:
        env.execute("HERMES_T_V=1")
        old = env._transport
        server.kill_user_sessions()
        assert wait_until(lambda: not old.is_active(), 10)
        r = env.execute('echo "$HERMES_T_V"')
        assert r.output == "1\n" and any("reconnected" in n for n in r.notes)
        assert env._transport is not old
        # The same, without giving paramiko time to notice the drop first.
        server.kill_user_sessions()
        assert env.execute('echo "$HERMES_T_V"').output == "1\n"
        # Nothing to report on a healthy connection.
        assert env.execute("true").notes == ()


def test_server_restart_between_commands_reconnects(private_sshd_server, tmp_path):
    server = private_sshd_server
    with _make(server, tmp_path) as env:
        env.execute("cd /tmp")
        server.restart()
        r = env.execute("pwd")
        assert r.output == "/tmp\n"


def test_unreachable_host_is_environment_unavailable(tmp_path):
    import socket

    from hermes_env_core.errors import EnvironmentUnavailable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(EnvironmentUnavailable, match=f"port {port}"):
            SSHEnvironment(host="127.0.0.1", port=port, user="nobody", known_hosts=str(tmp_path / "kh"))


# -- the remote process tree ---------------------------------------------------------


_TREE = "sleep {m}1 & (sleep {m}2 &); setsid sleep {m}3 & bash -c 'sleep {m}4; :'"


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_timeout_and_cancel_kill_the_remote_tree(sshd_server, tmp_path, how):
    marker = "77.3" if how == "timeout" else "78.3"
    with _make(sshd_server, tmp_path) as env:
        cancel = threading.Event()
        kw: dict[str, object] = {"timeout": 1} if how == "timeout" else {"cancel": cancel}
        if how == "cancel":
            threading.Thread(
                target=lambda: wait_until(lambda: len(_user_procs(sshd_server, f"sleep {marker}")) == 4, 10)
                and cancel.set()
            ).start()
        try:
            r = env.execute(_TREE.format(m=marker) + "; echo not-reached", **kw)
            assert (r.timed_out if how == "timeout" else r.interrupted) and "not-reached" not in r.output
            assert wait_until(lambda: not _user_procs(sshd_server, f"sleep {marker}"), 10), (
                f"left behind: {_user_procs(sshd_server, f'sleep {marker}')}"
            )
            assert env.execute("echo usable").output == "usable\n"
        finally:
            _kill_user_procs(sshd_server, f"sleep {marker}")


def test_background_child_adds_little(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path) as env:
        try:
            plain = min(env.execute("echo x").duration_s for _ in range(5))
            bg = min(env.execute("sleep 79.3 & echo x").duration_s for _ in range(5))
            assert bg - plain < 0.05, (plain, bg)
            # all still running (the last one may be a moment from its exec)
            assert wait_until(lambda: len(_user_procs(sshd_server, "sleep 79.3")) == 5, 10.0)
        finally:
            _kill_user_procs(sshd_server, "sleep 79.3")


def test_killed_by_signal_is_an_exit_code(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path) as env:
        if env.session_mode == "server":
            # $$ is the session's own shell: killing it is an infrastructure error, then a new one goes on.
            env.execute("HERMES_T_SIG=kept")
            with pytest.raises(BackendError, match="lost"):
                env.execute("kill -9 $$")
            r = env.execute('echo "$HERMES_T_SIG"')
            assert r.output == "kept\n" and any("new session server" in n for n in r.notes), r.notes
        else:
            assert env.execute("kill -9 $$").exit_code == 137
        assert env.execute("bash -c 'kill -TERM $$'; echo $?").output.endswith("143\n")
        assert env.execute("echo alive").output == "alive\n"


# -- remote specifics -------------------------------------------------------------


def test_remote_home_and_default_cwd(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path) as env:
        assert env.remote_home == str(sshd_server.home)
        r = env.execute("pwd")
        assert r.output == f"{sshd_server.home}\n" and r.cwd == str(sshd_server.home)


def test_cwd_tilde_is_the_remote_home(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path) as env:
        env.execute("mkdir -p ~/hermes_t_sub")
    try:
        with _make(sshd_server, tmp_path, cwd="~/hermes_t_sub") as env:
            assert env.execute("pwd").output == f"{sshd_server.home}/hermes_t_sub\n"
    finally:
        shutil.rmtree(sshd_server.home / "hermes_t_sub", ignore_errors=True)


def test_env_option_sets_remote_variables(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path, env={"HERMES_T_OPT": "a 'b' $c"}) as env:
        assert env.execute('printf %s "$HERMES_T_OPT"; bash -c \'printf /%s "$HERMES_T_OPT"\'').output == (
            "a 'b' $c/a 'b' $c"
        )


def test_login_shell_noise_never_reaches_output(private_sshd_server, tmp_path):
    server = private_sshd_server
    rc = server.home / ".bashrc"
    original = rc.read_bytes()
    try:
        rc.write_bytes(b"echo NOISE-FROM-BASHRC\n" + original)
        with _make(server, tmp_path) as env:
            assert env.execute("echo clean").output == "clean\n"
            out = env.sync_transport().download("/etc", "hostname")
            assert out is not None
            with tarfile.open(fileobj=io.BytesIO(out.read())) as tar:
                assert tar.getnames() == ["hostname"]
    finally:
        rc.write_bytes(original)


def test_state_in_a_private_remote_dir_removed_at_close(sshd_server, tmp_path):
    env = _make(sshd_server, tmp_path)
    env.execute("true")
    d = Path(env._state_dir())
    assert d.parent in (Path("/dev/shm"), Path("/tmp"))
    st = d.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == sshd_server.uid
    # The session server reads its script as ./bash there (the old path keeps .state files).
    assert any(p.name.endswith(".state") or (p.name == "bash" and p.is_symlink()) for p in d.iterdir())
    env.close()
    assert not d.exists()


# -- sync transport ---------------------------------------------------------------


def test_sync_transport_round_trip(sshd_server, tmp_path):
    from hermes_env_core.sync.transport import FileSyncTransport

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("a.txt", b"alpha\n"), ("sub/b.bin", bytes(range(256)) * 4000)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    size = buf.tell()
    buf.seek(0)
    root = f"{sshd_server.home}/hermes_t_sync"
    with _make(sshd_server, tmp_path) as env:
        transport = env.sync_transport()
        assert isinstance(transport, FileSyncTransport)
        try:
            transport.upload(root, buf, size)
            assert env.execute(f"cat {root}/a.txt; stat -c %Y {root}/a.txt").output == "alpha\n1700000000\n"
            out = transport.download(root)
            assert out is not None
            with tarfile.open(fileobj=io.BytesIO(out.read())) as tar:
                names = sorted(n for n in tar.getnames() if n not in (".",))
                assert names == ["./a.txt", "./sub", "./sub/b.bin"]
                assert tar.extractfile("./sub/b.bin").read() == bytes(range(256)) * 4000
            transport.delete(root, ["a.txt", "sub/b.bin", "missing"], ["sub"])
            assert env.execute(f"ls -A {root}").output == ""
            assert transport.download(f"{root}/nope") is None
        finally:
            env.execute(f"rm -rf {root}")


def test_sync_transport_uses_the_reconnecting_connection(private_sshd_server, tmp_path):
    from hermes_env_core.sync.transport import TransportError

    server = private_sshd_server
    kh = tmp_path / "known_hosts"
    with _make(server, tmp_path, known_hosts=str(kh)) as env:
        transport = env.sync_transport()
        old = env._transport
        server.kill_user_sessions()
        assert wait_until(lambda: not old.is_active(), 10)
        out = transport.download("/etc", "hostname")
        assert out is not None and out.read(512)
        out.close()
        assert env._transport is not old
        server.regenerate_host_key()
        with pytest.raises(TransportError) as e:
            transport.download("/etc", "hostname")
        assert not e.value.transient and str(kh) in str(e.value)


def test_more_concurrent_commands_than_the_server_allows_channels(sshd_server, tmp_path):
    from tests.support.sshd import SshServer

    with SshServer(extra_config={"MaxSessions": "3"}) as server, _make(server, tmp_path) as env:
        results: list[str] = []

        def run(i: int) -> None:
            results.append(env.execute(f"sleep 0.3; echo {i}").output)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == sorted(f"{i}\n" for i in range(8))


# -- another user on the ssh host (issue 11) ----------------------------------------------
def _as_other_user(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on the ssh host (this machine) as uid 4243, not the session's user."""
    return subprocess.run(
        ["setpriv", "--reuid=4243", "--regid=4243", "--clear-groups", "bash", "-c", script],
        capture_output=True, text=True, timeout=60, check=False,
    )


def test_other_user_on_the_host_sees_no_secret_on_any_command_line(sshd_server, tmp_path):
    secret = "s3cr3t-" + os.urandom(8).hex()
    with _make(sshd_server, tmp_path, env={"HERMES_T_CFG": secret}) as env:
        env.execute(f"export HERMES_T_EXP={secret}-exported; HERMES_T_PLAIN={secret}-plain")
        started = threading.Event()
        stop = threading.Event()
        t = threading.Thread(
            target=lambda: env.execute(
                "echo running; sleep 60.37", cancel=stop, on_output=lambda s: started.set() if "running" in s else None
            )
        )
        t.start()
        try:
            assert started.wait(30)
            dump = _as_other_user('for f in /proc/[0-9]*/cmdline; do tr "\\0" " " <"$f"; echo; done').stdout
        finally:
            stop.set()
            t.join(60)
        assert "sleep 60.37" in dump  # it saw the session's running command
        assert secret not in dump


def test_other_user_on_the_host_cannot_enter_or_plant_state(sshd_server, tmp_path):
    with _make(sshd_server, tmp_path) as env:
        env.execute("alias hermes_t_mine='echo mine'; HERMES_T_V=session")
        d = env.session.state_dir
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and os.stat(d).st_uid != 4243
        r = _as_other_user(
            f"ls {d}; echo 'hermes_t_evil() {{ echo pwned; }}' >{d}/.hermes-x-0.state; "
            f"ln -s /dev/null {d}/.hermes-x-1.state; echo done"
        )
        assert r.stderr.count("Permission denied") >= 3 and "done" in r.stdout, r.stderr
        out = env.execute("hermes_t_mine; echo $HERMES_T_V; type hermes_t_evil 2>&1 | head -1", timeout=20).output
        assert out.startswith("mine\nsession\n") and "pwned" not in out
