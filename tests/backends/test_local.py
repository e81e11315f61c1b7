"""The local backend: the conformance suite plus what only local has."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from hermes_env_core.backends.local import LocalConfig, LocalEnvironment, filter_environment
from hermes_env_core.testing import EnvironmentConformance, wait_until


class TestLocalConformance(EnvironmentConformance):
    """Through the resident shell channel (the default)."""

    @pytest.fixture
    def environment(self):
        with LocalEnvironment(timeout=60, channel=True) as env:
            yield env
            assert env.channel_mode == "channel"


class TestLocalProcessConformance(EnvironmentConformance):
    """One process per command (the fallback path)."""

    @pytest.fixture
    def environment(self):
        with LocalEnvironment(timeout=60, channel=False) as env:
            yield env


@pytest.fixture
def env():
    with LocalEnvironment() as e:
        yield e


def test_secrets_filtered_and_passthrough(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "t")
    monkeypatch.setenv("DB_PASSWORD", "p")
    monkeypatch.setenv("HARMLESS", "h")
    monkeypatch.setenv("ALLOWED_TOKEN", "ok")
    with LocalEnvironment(env_passthrough=("ALLOWED_*",)) as env:
        r = env.execute('echo "${OPENAI_API_KEY-no} ${MY_SERVICE_TOKEN-no} ${DB_PASSWORD-no} $HARMLESS $ALLOWED_TOKEN"')
    assert r.output == "no no no h ok\n"


def test_filter_environment_case_insensitive():
    out = filter_environment({"github_token": "x", "PATH": "/bin"})
    assert out == {"PATH": "/bin"}


def test_explicit_env_values_set():
    with LocalEnvironment(env={"HERMES_T_GIVEN": "v"}) as env:
        assert env.execute('echo "$HERMES_T_GIVEN"').output == "v\n"


def test_state_files_are_private(env):
    env.execute("true")
    d = env._state_dir()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    files = [os.path.join(d, f) for f in os.listdir(d)]
    assert files
    for f in files:
        if os.path.islink(f):  # the session server reads its script through ./bash
            assert os.readlink(f) == "/dev/fd/3", f
            continue
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_cleanup_removes_state_dir():
    env = LocalEnvironment()
    env.execute("true")
    d = env._state_dir()
    env.close()
    assert not os.path.exists(d)
    with pytest.raises(Exception, match="closed"):
        env.execute("true")


def test_login_profile_applies(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".profile").write_text('export PATH="$HOME/mybin:$PATH"\nexport FROM_PROFILE=yes\n')
    (home / "mybin").mkdir()
    tool = home / "mybin" / "hermes-tool"
    tool.write_text("#!/bin/sh\necho tool-ran\n")
    tool.chmod(0o755)
    with LocalEnvironment(env={"HOME": str(home)}, login=True) as env:
        r = env.execute("hermes-tool; echo $FROM_PROFILE")
        assert r.output == "tool-ran\nyes\n"
        assert not env._login_each
    # Without login the profile does not apply.
    with LocalEnvironment(env={"HOME": str(home)}) as env:
        assert env.execute('echo "${FROM_PROFILE-none}"').output == "none\n"


def test_caller_path_and_virtualenv_kept(tmp_path):
    """The caller's PATH, an activated virtualenv first, reaches the session as it is (no login profile)."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    tool = venv_bin / "hermes-venv-tool"
    tool.write_text("#!/bin/sh\necho from-venv\n")
    tool.chmod(0o755)
    path = f"{venv_bin}:{os.environ['PATH']}"
    with LocalEnvironment(env={"PATH": path, "VIRTUAL_ENV": str(venv_bin.parent)}) as env:
        r = env.execute('echo "$PATH"; command -v hermes-venv-tool; hermes-venv-tool; echo "$VIRTUAL_ENV"')
        assert r.output == f"{path}\n{tool}\nfrom-venv\n{venv_bin.parent}\n"
    with LocalEnvironment() as env:
        assert env.execute('echo "$PATH"').output == os.environ["PATH"] + "\n"


def test_profile_that_exits_is_skipped_with_a_note(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".profile").write_text("export FROM_PROFILE=partial\nexit 3\n")
    with LocalEnvironment(env={"HOME": str(home)}, login=True) as env:
        r = env.execute('echo "ok ${FROM_PROFILE-none}"')
        assert r.exit_code == 0 and r.output == "ok none\n"
        assert any("login shell start-up failed (exit 3)" in n for n in r.notes)
        assert not env._login_each


def test_unreadable_login_state_falls_back_to_login_each_command(tmp_path, monkeypatch):
    from hermes_env_core.environment import session as session_mod

    home = tmp_path / "home"
    home.mkdir()
    (home / ".profile").write_text("export FROM_PROFILE=yes\n")
    real_accept = session_mod.ShellSession.accept
    calls = []

    def accept(self, wrapped, frame, *, as_baseline=False):
        calls.append(as_baseline)
        if len(calls) == 2:  # the login snapshot
            raise session_mod.StateParseError("simulated")
        return real_accept(self, wrapped, frame, as_baseline=as_baseline)

    monkeypatch.setattr(session_mod.ShellSession, "accept", accept)
    # The process-per-command path (no session server) reads a login snapshot back.
    with LocalEnvironment(env={"HOME": str(home)}, channel=False) as env:
        r = env.execute('echo "$FROM_PROFILE"; shopt -q login_shell && echo login')
        assert env._login_each
        assert r.output == "yes\nlogin\n"


def test_grandchild_keeps_running_after_return(env, tmp_path):
    marker = tmp_path / "m"
    r = env.execute(f"(sleep 0.3; echo done > {marker}) & echo bg")
    assert r.output == "bg\n"
    from hermes_env_core.testing import wait_until

    assert wait_until(marker.exists, 10)


def test_bounded_capture_spills_full_output(tmp_path):
    with LocalEnvironment(max_output_bytes=4096, spill_dir=str(tmp_path)) as env:
        r = env.execute("seq 1 20000")
    assert r.truncated and r.output_path
    with open(r.output_path) as f:
        full = f.read()
    assert full == "".join(f"{i}\n" for i in range(1, 20001))
    assert r.output.startswith("1\n2\n3\n") and r.output.endswith("19999\n20000\n")
    assert str(r.dropped_bytes) in r.output


def test_yes_until_timeout_memory_bounded():
    script = textwrap.dedent(
        """
        import resource
        from hermes_env_core.backends.local import LocalEnvironment
        with LocalEnvironment() as env:
            env.execute("true")
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            r = env.execute("yes", timeout=2)
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert r.timed_out and r.truncated, r
        print((after - before) // 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) < 64


def test_a_slow_consumer_holds_the_command_back_instead_of_buffering_its_output():
    """The output callback is slow (a busy caller, a loaded machine): the command waits on
    its pipe, as on a slow terminal; this process does not read ahead without bound."""
    script = textwrap.dedent(
        """
        import resource, time
        from hermes_env_core.backends.local import LocalEnvironment
        with LocalEnvironment() as env:
            env.execute("true")
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            r = env.execute("yes", timeout=2, on_output=lambda text: time.sleep(0.01))
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert r.timed_out, r
        print((after - before) // 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) < 64


def test_missing_bash_is_a_clear_error():
    from hermes_env_core.errors import EnvironmentUnavailable

    with pytest.raises(EnvironmentUnavailable, match="no-such-bash"):
        LocalEnvironment(bash="no-such-bash")


def test_unknown_option_rejected():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="imagee"):
        LocalConfig(imagee="x")


def test_configured_cwd_missing_is_126_then_recovers():
    with LocalEnvironment(cwd="/no/such/hermes/start") as env:
        r = env.execute("pwd")
        assert r.exit_code == 126 and "/no/such/hermes/start" in r.output
        assert any("reset" in n for n in r.notes)
        assert env.execute("echo ok").output == "ok\n"


def test_configured_cwd_is_the_start_directory(tmp_path):
    with LocalEnvironment(cwd=str(tmp_path)) as env:
        assert env.execute("pwd").output == f"{tmp_path}\n"


def test_a_server_closed_with_its_read_ahead_full_reads_as_ended_at_once():
    import time

    from hermes_env_core.environment.server import ServerLost

    with LocalEnvironment() as env:
        env.execute("true")
        server = env._server_runner()._server
        server.send_command("yes", cwd=None, stdin=None)
        assert wait_until(lambda: server._chunks.full(), 20)
        server.close()
        started = time.monotonic()
        with pytest.raises(ServerLost):
            server._next(30.0)
        assert time.monotonic() - started < 5
