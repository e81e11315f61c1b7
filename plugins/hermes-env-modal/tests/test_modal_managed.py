"""Managed mode beyond the conformance suite: bearer auth, idempotent retries,
connect and read timeouts, credential files refused, sandboxes kept on
timeout and replaced when they end. Against the gateway's HTTP emulator."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
from hermes_env_modal import ModalEnvironment
from hermes_env_modal.gateway import GatewayAuthError
from hermes_env_modal.managed import ManagedModalEnvironment

from hermes_env_core.errors import ConfigError, EnvironmentUnavailable


def _env(gw, **kw):
    opts = dict(mode="managed", gateway_url=gw.url, gateway_token=gw.token, task_id=f"m-{uuid.uuid4().hex[:8]}")
    opts.update(kw)
    return ModalEnvironment(**opts)


def test_is_the_managed_class_and_never_runs_local_bash(gateway):
    with _env(gateway) as env:
        assert isinstance(env, ManagedModalEnvironment)
        assert env.execute("echo hi").output == "hi\n"


def test_wrong_token_is_refused_with_the_fix(fresh_gateway):
    with pytest.raises(GatewayAuthError, match="gateway_token"):
        _env(fresh_gateway, gateway_token="wrong")
    assert not fresh_gateway.sandboxes


def test_every_request_carries_the_bearer_token_and_keys_on_posts(fresh_gateway):
    with _env(fresh_gateway) as env:
        env.execute("true")
    posts = [(p, k) for m, p, k in fresh_gateway.calls if m == "POST" and not p.endswith("/cancel")]
    assert posts and all(k for _, k in posts)
    assert len({k for _, k in posts}) == len(posts)  # a fresh key per logical call


def test_lost_create_answer_is_retried_with_the_same_key(fresh_gateway):
    fresh_gateway.drop_next("POST", "/v1/sandboxes")
    with _env(fresh_gateway) as env:
        assert len(fresh_gateway.sandboxes) == 1
        creates = [k for m, p, k in fresh_gateway.calls if m == "POST" and p == "/v1/sandboxes"]
        assert len(creates) == 2 and creates[0] == creates[1]
        assert env.execute("echo ok").output == "ok\n"


def test_lost_exec_answer_runs_the_command_once(fresh_gateway):
    with _env(fresh_gateway) as env:
        fresh_gateway.drop_next("POST", "/v1/sandboxes/*/execs")
        assert env.execute("echo once >> counter; cat counter").output == "once\n"
        assert fresh_gateway.count("POST", "/v1/sandboxes/*/execs") == 2


def test_read_timeout_retry_does_not_run_the_command_twice(fresh_gateway):
    with _env(fresh_gateway, read_timeout=0.5) as env:
        fresh_gateway.delay_next("POST", "/v1/sandboxes/*/execs", 1.5)
        started = time.monotonic()
        r = env.execute("echo run >> counter; cat counter")
        assert r.output == "run\n" and r.exit_code == 0
        assert time.monotonic() - started < 10
        keys = [k for m, p, k in fresh_gateway.calls if m == "POST" and p.endswith("/execs")]
        assert len(keys) >= 2 and len(set(keys)) == 1


def test_transient_errors_are_retried_then_reported(fresh_gateway):
    with _env(fresh_gateway, gateway_retries=2) as env:
        fresh_gateway.fail_next("POST", "/v1/sandboxes/*/execs", 503)
        assert env.execute("echo after-503").output == "after-503\n"
        fresh_gateway.fail_next("POST", "/v1/sandboxes/*/execs", 503, count=3)
        with pytest.raises(EnvironmentUnavailable, match="after 3 attempts.*503"):
            env.execute("echo never")


def test_connect_timeout_from_config():
    # A listener whose backlog is full never completes a handshake: connect hangs.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(c)
    try:
        started = time.monotonic()
        with pytest.raises(EnvironmentUnavailable, match="ConnectTimeout"):
            ModalEnvironment(
                mode="managed", gateway_url=f"http://127.0.0.1:{port}", gateway_token="t",
                connect_timeout=0.3, gateway_retries=1,
            )
        assert time.monotonic() - started < 5
    finally:
        for c in fillers:
            c.close()
        srv.close()


def test_credential_files_are_refused(gateway, tmp_path):
    cred = tmp_path / "creds"
    cred.write_text("x")
    with pytest.raises(ConfigError, match="credential files"):
        _env(gateway, credential_files=[str(cred)])
    with pytest.raises(ConfigError, match="credential files"):
        _env(gateway, sync=[{"host": str(tmp_path), "remote": "x", "upload_only": True}])


def test_timeout_and_cancel_keep_the_sandbox(fresh_gateway):
    with _env(fresh_gateway) as env:
        sid = env.sandbox_id
        env.execute("export KEPT=1")
        r = env.execute("echo part; sleep 30", timeout=1)
        assert (r.exit_code, r.timed_out, r.output) == (124, True, "part\n")
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        r = env.execute("sleep 30", cancel=cancel, timeout=60)
        assert (r.exit_code, r.interrupted) == (130, True) and r.duration_s < 10
        assert env.sandbox_id == sid and not fresh_gateway.sandboxes[sid].ended
        assert env.execute('echo "$KEPT"').output == "1\n"


def test_cwd_not_enterable_is_126(gateway):
    with _env(gateway) as env:
        r = env.execute("pwd", cwd="/no/such/dir/hermes")
        assert r.exit_code == 126 and "/no/such/dir/hermes" in r.output


def test_an_ended_sandbox_is_replaced_with_a_note(fresh_gateway):
    with _env(fresh_gateway) as env:
        old = env.sandbox_id
        fresh_gateway.end_sandbox(old)
        r = env.execute("echo again")
        assert r.output == "again\n" and env.sandbox_id != old
        assert any("had ended" in n for n in r.notes)


def test_output_over_several_polls_is_bounded_like_the_base_class(gateway):
    with _env(gateway, max_output_bytes=64 * 1024) as env:
        r = env.execute("head -c 10000000 /dev/zero | tr '\\0' z; echo; echo END")
        assert r.truncated and r.output.endswith("z\nEND\n") and "bytes omitted" in r.output
        assert r.dropped_bytes > 10000000 - 64 * 1024 - 1


def test_close_terminates_the_sandbox(fresh_gateway):
    env = _env(fresh_gateway)
    sid = env.sandbox_id
    env.close()
    assert fresh_gateway.sandboxes[sid].ended
    assert fresh_gateway.count("POST", f"/v1/sandboxes/{sid}/terminate") == 1
