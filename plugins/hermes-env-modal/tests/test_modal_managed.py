"""Managed mode beyond the conformance suite: bearer auth, idempotent retries,
connect and read timeouts, credential files refused, sandboxes kept on
timeout and replaced when they end. Against the gateway's HTTP emulator."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

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


def test_wrong_token_is_refused_naming_its_source(fresh_gateway):
    with pytest.raises(GatewayAuthError, match="401.*configured token"):
        _env(fresh_gateway, gateway_token="wrong")
    assert not fresh_gateway.sandboxes


def test_create_speaks_the_gateways_contract(fresh_gateway):
    with _env(fresh_gateway, image="python:3.12-slim", cpu=2, memory="2g", sandbox_timeout=900,
              idle_timeout=120, workdir="/root", task_id="task-7") as env:
        assert env.execute("echo hi").output == "hi\n"
    (create,) = [b for m, p, b in fresh_gateway.bodies if m == "POST" and p == "/v1/sandboxes"]
    assert create == {
        "image": "python:3.12-slim", "cwd": "/root", "cpu": 2, "memoryMiB": 2048, "timeoutMs": 900_000,
        "idleTimeoutMs": 120_000, "persistentFilesystem": False, "logicalKey": "task-7",
    }
    (hdrs,) = [h for m, p, h in fresh_gateway.calls if m == "POST" and p == "/v1/sandboxes"]
    assert hdrs.get("x-idempotency-key")
    execs = [b for m, p, b in fresh_gateway.bodies if m == "POST" and p.endswith("/execs")]
    assert execs and all({"execId", "command", "cwd", "timeoutMs"} <= set(b) <= {
        "execId", "command", "cwd", "timeoutMs", "stdinData"} for b in execs)
    assert all(b["cwd"] == "/root" and b["command"].startswith("exec ") for b in execs)
    assert len({b["execId"] for b in execs}) == len(execs)
    (term,) = [b for m, p, b in fresh_gateway.bodies if p.endswith("/terminate")]
    assert term == {"snapshotBeforeTerminate": False}


def test_lost_create_answer_is_retried_with_the_same_key(fresh_gateway):
    fresh_gateway.drop_next("POST", "/v1/sandboxes")
    with _env(fresh_gateway) as env:
        assert len(fresh_gateway.sandboxes) == 1
        creates = [h["x-idempotency-key"] for m, p, h in fresh_gateway.calls if m == "POST" and p == "/v1/sandboxes"]
        assert len(creates) == 2 and creates[0] == creates[1]
        assert env.execute("echo ok").output == "ok\n"


def test_an_expired_token_is_read_again_from_the_auth_store(fresh_gateway, tmp_path):
    # The seed system's token source: providers.nous.access_token of $HERMES_HOME/auth.json,
    # kept fresh by its own login flow; the gateway refuses an expired token with 401.
    first = fresh_gateway.issue_token(ttl=None)
    store = tmp_path / "auth.json"

    def write(token: str, expires: str) -> None:
        store.write_text(json.dumps({"providers": {"nous": {"access_token": token, "expires_at": expires}}}))

    write(first, "2999-01-01T00:00:00Z")
    with ModalEnvironment(mode="managed", gateway_url=fresh_gateway.url, gateway_auth_file=str(store),
                          task_id=f"m-{uuid.uuid4().hex[:8]}") as env:
        assert env.execute("export KEEP=1; echo a").output == "a\n"
        fresh_gateway.revoke(first)  # expired at the gateway before its stated expiry
        second = fresh_gateway.issue_token(ttl=None)
        soon = (datetime.now(timezone.utc) + timedelta(seconds=60)).isoformat()
        write(second, soon)
        assert env.execute('echo "$KEEP"').output == "1\n"
        assert fresh_gateway.refused == 1
        # A token the store says expires within two minutes is read again before each use.
        third = fresh_gateway.issue_token(ttl=None)
        write(third, "2999-01-01T00:00:00Z")
        fresh_gateway.revoke(second)
        assert env.execute("echo c").output == "c\n"
        assert fresh_gateway.refused == 1  # only the revoked first token was ever refused


def test_a_static_token_that_expires_is_reported(fresh_gateway):
    token = fresh_gateway.issue_token(ttl=None)
    with _env(fresh_gateway, gateway_token=token) as env:
        fresh_gateway.revoke(token)
        with pytest.raises(GatewayAuthError, match="configured token"):
            env.execute("true")
    assert fresh_gateway.refused >= 2  # the command, then the terminate at close (logged, not raised)


def test_lost_exec_answer_runs_the_command_once(fresh_gateway):
    with _env(fresh_gateway) as env:
        fresh_gateway.drop_next("POST", "/v1/sandboxes/*/execs")
        assert env.execute("echo once >> counter; cat counter").output == "once\n"
        ids = [b["execId"] for m, p, b in fresh_gateway.bodies if m == "POST" and p.endswith("/execs")]
        assert len(ids) == len(set(ids)) + 1  # one start sent twice, with the same execId
        assert len(fresh_gateway.execs_of("counter")) == 1


def test_read_timeout_retry_does_not_run_the_command_twice(fresh_gateway):
    with _env(fresh_gateway, read_timeout=0.5) as env:
        fresh_gateway.delay_next("POST", "/v1/sandboxes/*/execs", 1.5)
        started = time.monotonic()
        r = env.execute("echo run >> counter; cat counter")
        assert r.output == "run\n" and r.exit_code == 0
        assert time.monotonic() - started < 10
        ids = [b["execId"] for m, p, b in fresh_gateway.bodies if m == "POST" and p.endswith("/execs")]
        assert len(ids) > len(set(ids))  # the retry names the same exec
        assert len(fresh_gateway.execs_of("counter")) == 1


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
        (sleeper,) = fresh_gateway.execs_of("sleep 30")[-1:]
        assert sleeper.status != "running"  # killed, not left behind
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
        r = env.execute("head -c 3000000 /dev/zero | tr '\\0' z; echo; echo END")
        assert r.truncated and r.output.endswith("z\nEND\n") and "bytes omitted" in r.output
        assert r.dropped_bytes > 3000000 - 64 * 1024 - 1


def test_close_terminates_the_sandbox(fresh_gateway):
    env = _env(fresh_gateway)
    sid = env.sandbox_id
    env.close()
    assert fresh_gateway.sandboxes[sid].ended
    assert fresh_gateway.count("POST", f"/v1/sandboxes/{sid}/terminate") == 1


def test_a_poll_cut_by_a_proxy_is_sent_again(fresh_gateway):
    with _env(fresh_gateway) as env:
        fresh_gateway.drop_next("GET", "/v1/sandboxes/*/execs/*", count=2)
        r = env.execute("sleep 0.5; echo late; exit 4")
        assert (r.output, r.exit_code) == ("late\n", 4)
        assert len(fresh_gateway.execs_of("echo late")) == 1


def test_an_image_without_bash_is_refused_with_what_it_lacks(fresh_gateway):
    fresh_gateway.image_lacks = {"bash"}
    with pytest.raises(ConfigError, match="no bash.*bash >= 4.4"):
        _env(fresh_gateway, image="alpine:3.20")
    (sb,) = fresh_gateway.sandboxes.values()
    assert sb.ended  # not left running


def test_latency_and_the_exit_status_of_each_command(fresh_gateway):
    fresh_gateway.latency = 0.05
    with _env(fresh_gateway) as env:
        for code in (0, 1, 3, 42):
            assert env.execute(f"exit {code}").exit_code == code
        assert env.execute("kill -9 $$").exit_code == 137


def test_a_long_script_travels_as_stdin_data(gateway):
    with _env(gateway) as env:
        big = "x" * 200_000
        r = env.execute(f"v={big}; echo ${{#v}}")
        assert r.output == "200000\n" and r.exit_code == 0
    long_execs = [b for m, p, b in gateway.bodies if p.endswith("/execs") and "stdinData" in b]
    assert long_execs and all(len(b["command"]) < 1000 for b in long_execs)


def test_stdin_is_stdin_data_and_binary_stdin_travels_as_base64(fresh_gateway):
    with _env(fresh_gateway) as env:
        assert env.execute("cat", stdin="text é\n").output == "text é\n"
        r = env.execute("od -An -tx1 | tr -d ' \\n'", stdin=b"\xff\x00a")
        assert r.output == "ff0061"
    fed = [b for m, p, b in fresh_gateway.bodies if p.endswith("/execs") and "stdinData" in b]
    # Stdin that is not UTF-8 (whether the core hands it over raw or inside its
    # private script) travels base64-encoded, decoded in the sandbox.
    assert all(not b["command"].startswith("base64") or "base64 -d | exec bash" in b["command"] for b in fed)
    assert all(isinstance(b["stdinData"], str) for b in fed)
    assert all("text é" not in b["command"] for b in fed)  # never on the command line


def test_stdin_that_is_not_utf8_goes_base64_and_arrives_byte_exact(fresh_gateway):
    with _env(fresh_gateway) as env:
        handle = env._run_bash("od -An -tx1 | tr -d ' \\n'", login=False, timeout=None, stdin_data=b"\xff\x00a")
        assert handle.stdout.read() == b"ff0061" and handle.wait(10) == 0
    (body,) = [b for m, p, b in fresh_gateway.bodies if p.endswith("/execs") and "od -An" in b["command"]]
    assert body["command"].startswith("base64 -d | exec bash") and body["stdinData"] == "/wBh"
