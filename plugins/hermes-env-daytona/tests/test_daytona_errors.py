"""Infrastructure failures are errors that say what to do, never a command result."""

from __future__ import annotations

import socket

import pytest
from daytona import CreateSandboxFromSnapshotParams, Daytona, DaytonaConfig
from hermes_env_daytona.backend import DaytonaEnvironment

from hermes_env_core.errors import BackendError, EnvironmentUnavailable


def _sdk_client(emu):
    return Daytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key))


def test_missing_credentials(emu, monkeypatch, tmp_path):
    monkeypatch.delenv("DAYTONA_API_KEY")
    monkeypatch.chdir(tmp_path)  # the SDK also reads a .env file in the working directory
    with pytest.raises(EnvironmentUnavailable, match="no credentials: set DAYTONA_API_KEY"):
        DaytonaEnvironment(task_id="t-nocreds")


def test_credentials_from_config_win_over_the_environment(emu, monkeypatch, make_env):
    monkeypatch.setenv("DAYTONA_API_KEY", "not-the-key")
    env = make_env(api_key=emu.api_key)
    assert env.execute("echo ok").output == "ok\n"


def test_rejected_key_is_401_with_the_fix(emu, make_env):
    env = make_env(api_key="wrong-key")
    with pytest.raises(EnvironmentUnavailable, match=r"API key was rejected .*401.*check DAYTONA_API_KEY"):
        env.execute("true")
    assert emu.sandboxes == {}


def test_key_revoked_during_a_session(emu, make_env):
    env = make_env()
    env.execute("true")
    emu.api_key = "rotated"
    # The open stream was authorized when it was opened; a new one is refused.
    assert env.execute("echo still").output == "still\n"
    env.execute("exit 0")  # the server ends: the next command needs a new stream
    with pytest.raises(EnvironmentUnavailable, match="401|credentials|Unauthorized"):
        env.execute("echo never")


def test_server_error_on_create(emu, make_env):
    env = make_env()
    emu.fail_next(500, method="POST", path=r"^/api/sandbox$")
    with pytest.raises(EnvironmentUnavailable, match=r"creating sandbox .*Daytona service failed \(HTTP 500\)"):
        env.execute("true")
    assert env.execute("echo recovered").output == "recovered\n"


def test_server_error_opening_a_stream(emu, make_env):
    env = make_env()
    env.execute("export KEEP=1")
    env.execute("exit 0")  # the server ends: the next command opens a new PTY session
    emu.fail_next(500, method="GET", path=r"/process/pty/create-connect$")
    with pytest.raises(EnvironmentUnavailable, match=r"HTTP 500"):
        env.execute("echo lost")
    r = env.execute("echo $KEEP")
    assert r.output == "1\n"


def test_rate_limit_on_create_is_retried(emu, make_env):
    env = make_env()
    emu.fail_next(429, method="POST", path=r"^/api/sandbox$")
    assert env.execute("echo ok").output == "ok\n"
    assert [r.status for r in emu.requests if r.method == "POST" and r.path == "/api/sandbox"] == [429, 200]


def test_persistent_rate_limit_is_an_error(emu, make_env):
    env = make_env()
    emu.fail_next(429, method="POST", path=r"^/api/sandbox$", times=3)
    with pytest.raises(EnvironmentUnavailable, match=r"rate limited .*429 Too Many Requests, retry after 1s"):
        env.execute("true")


def test_quota_exceeded(emu, make_env):
    emu.max_total_cpu = 2
    env = make_env(image="debian:12", cpu=3)
    with pytest.raises(EnvironmentUnavailable, match=r"quota exceeded \(403\): Total CPU limit exceeded.*fewer resources"):
        env.execute("true")


def test_create_that_lands_in_error_state(emu, make_env):
    emu.create_next_in_state("error", reason="no runner available")
    env = make_env(create_timeout=10)
    with pytest.raises(EnvironmentUnavailable, match=r"is in state error: no runner available; delete it"):
        env.execute("true")


def test_existing_sandbox_in_error_state(emu, make_env, task_id):
    sb = _sdk_client(emu).create(CreateSandboxFromSnapshotParams(name=f"hermes-{task_id}"))
    emu.force_state(sb.id, "error", reason="disk failure", recoverable=False)
    env = make_env()
    with pytest.raises(EnvironmentUnavailable, match="is in state error: disk failure"):
        env.execute("true")


def test_existing_sandbox_in_recoverable_error_state_is_recovered(emu, make_env, task_id):
    sb = _sdk_client(emu).create(CreateSandboxFromSnapshotParams(name=f"hermes-{task_id}"))
    emu.force_state(sb.id, "error", reason="transient", recoverable=True)
    r = make_env().execute("echo back")
    assert r.output == "back\n"
    assert any("recovered sandbox" in n for n in r.notes)


def test_sandbox_enters_error_state_during_a_session(emu, make_env):
    env = make_env()
    env.execute("true")
    emu.force_state(env.sandbox.id, "error", reason="host lost", recoverable=False)
    with pytest.raises(EnvironmentUnavailable, match="is in state error: host lost"):
        env.execute("echo never")


def test_unreachable_api(monkeypatch, make_env, emu):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = make_env(api_url=f"http://127.0.0.1:{port}/api")
    with pytest.raises(EnvironmentUnavailable, match=rf"cannot reach the Daytona API at http://127.0.0.1:{port}/api"):
        env.execute("true")


def test_daemon_time_limit_is_an_error_not_a_result(emu, make_env):
    # Helper scripts run through process.exec, which the daemon ends at the call's time
    # limit with 408 REQUEST_TIMEOUT: an error, never an exit status.
    env = make_env()
    env.execute("true")
    with pytest.raises(BackendError, match=r"daemon ended the command at its time limit \(1s, HTTP 408 REQUEST_TIMEOUT\)"):
        env.run_script("sleep 5", "a helper", timeout=1)
    assert env.execute("echo next").output == "next\n"


def test_signal_killed_helper_is_an_error_not_an_exit_status(emu, make_env):
    # The daemon reports -1 for a shell a signal ended (Go's ExitCode()): the status is unknown.
    env = make_env()
    env.execute("true")
    with pytest.raises(BackendError, match=r"daemon reports exit code -1"):
        env.run_script("kill -KILL $$", "a helper")


def test_gateway_cut_of_a_helper_is_an_error(emu, make_env):
    env = make_env()
    env.execute("true")
    emu.proxy_timeout = 0.5
    with pytest.raises(BackendError, match=r"cut the request \(HTTP 504\)"):
        env.run_script("sleep 2", "a helper")
    assert emu.cut_requests == 1
