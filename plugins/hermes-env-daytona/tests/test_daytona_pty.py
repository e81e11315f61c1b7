"""PTY sessions: the emulator's endpoint as the SDK sees it, the raw byte stream the
backend makes of one, and the session server on it when the sandbox goes away."""

from __future__ import annotations

import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hermes_env_core.errors import EnvironmentUnavailable
from hermes_env_daytona._pty import open_pty_stream


@pytest.fixture
def sandbox(emu):
    from daytona import Daytona, DaytonaConfig

    client = Daytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key))
    sb = client.create()
    yield sb
    try:
        client.delete(sb)
    except Exception:  # noqa: BLE001, S110 - a test may have deleted it
        pass


def _drain(handle, timeout: float = 10.0) -> tuple[bytes, object]:
    out: list[bytes] = []
    result = handle.wait(on_data=out.append, timeout=timeout)
    return b"".join(out), result


# -- the emulated daemon endpoint -----------------------------------------------------------
def test_pty_session_is_the_daemon_shell_on_a_terminal(sandbox):
    handle = sandbox.process.create_pty_session("t1", envs={"HERMES_T_PTY": "a b"})
    handle.send_input("tty >/dev/null && echo on-a-tty; echo \"[$HERMES_T_PTY][$TERM]\"; exit 3\n")
    out, result = _drain(handle)
    # a terminal: what was typed is echoed, and output lines end in CR LF (onlcr)
    assert b"on-a-tty\r\n[a b][xterm-256color]\r\n" in out
    assert (result.exit_code, result.error) == (3, "non-zero exit")
    with pytest.raises(Exception, match="not found"):
        sandbox.process.get_pty_session_info("t1")  # gone once its shell ended


def test_pty_sessions_are_listed_resized_and_killed(sandbox):
    from daytona import DaytonaConflictError, PtySize

    handle = sandbox.process.create_pty_session("t2", pty_size=PtySize(rows=30, cols=100))
    info = sandbox.process.get_pty_session_info("t2")
    assert (info.cols, info.rows, info.active) == (100, 30, True)
    with pytest.raises(DaytonaConflictError):
        sandbox.process.create_pty_session("t2")
    assert sandbox.process.resize_pty_session("t2", PtySize(rows=10, cols=40)).cols == 40
    handle.send_input("stty size\n")
    second = sandbox.process.connect_pty_session("t2")  # a second client sees the same terminal
    second.send_input("sleep 300 & echo started-$((6 * 7))-$!\n")
    seen = b""
    deadline = time.monotonic() + 10
    while b"started-42-" not in seen and time.monotonic() < deadline:
        seen += b"".join(second._handle_events(time.monotonic() + 0.5))  # noqa: SLF001 - read without waiting for exit
    assert [s.id for s in sandbox.process.list_pty_sessions()] == ["t2"]
    pid = int(seen.split(b"started-42-")[1].split(b"\r")[0])
    sandbox.process.kill_pty_session("t2")
    out, result = _drain(handle)
    assert b"10 40" in out
    assert (result.exit_code, result.error) == (137, "SIGKILL")
    assert _drain(second)[1].exit_code == 137
    # the daemon kills the shell's descendants too, background jobs included
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    second.disconnect()
    handle.disconnect()


def test_connecting_to_a_missing_session_fails(sandbox):
    with pytest.raises(Exception, match="PTY session .*not found|Connection closed|Failed to connect"):
        sandbox.process.connect_pty_session("nope")


def test_stopping_the_sandbox_cuts_its_terminals(emu, sandbox):
    handle = sandbox.process.create_pty_session("t3")
    emu.force_state(sandbox.id, "stopped")
    t0 = time.monotonic()
    _out, result = _drain(handle, timeout=20)
    assert time.monotonic() - t0 < 10  # the connection ended; wait() did not run out its time
    assert result.exit_code is None  # cut, not closed with an exit status
    assert emu.sandboxes[sandbox.id].ptys == {}


# -- the raw stream ---------------------------------------------------------------------
@pytest.fixture
def echo_stream(sandbox):
    # one line per frame: a length, then that many bytes echoed back
    program = 'while IFS= read -r n; do head -c "$n"; done'
    stream = open_pty_stream(sandbox, ["bash", "-c", program])
    yield stream
    stream.close()


def _read_exact(stream, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = stream.read(n - len(out))
        assert chunk, f"stream ended after {len(out)} of {n} bytes"
        out += chunk
    return out


def _echo(stream, data: bytes) -> bytes:
    stream.write(b"%d\n" % len(data) + data)
    return _read_exact(stream, len(data))


def test_every_byte_value_passes_both_ways(echo_stream):
    everything = bytes(range(256))
    assert _echo(echo_stream, everything * 4) == everything * 4
    # what a terminal would act on, each alone: NUL, ^C, ^D, ^Z, ^\, ^S, ^Q, ^V, ^O, ^U, CR, DEL, ESC
    for byte in b"\x00\x03\x04\x1a\x1c\x13\x11\x16\x0f\x15\r\x7f\x1b":
        assert _echo(echo_stream, bytes([byte])) == bytes([byte])
        assert _echo(echo_stream, b"\r\n" + bytes([byte]) * 3 + b"\n") == b"\r\n" + bytes([byte]) * 3 + b"\n"
    assert _echo(echo_stream, b"still here") == b"still here"
    # a chunk with no NUL goes up as a frame bash reads itself: every other byte value, alone and together
    no_nul = bytes(range(1, 256))
    assert _echo(echo_stream, no_nul * 2) == no_nul * 2
    for byte in no_nul:
        assert _echo(echo_stream, bytes([byte]) * 2 + b"\\\n") == bytes([byte]) * 2 + b"\\\n"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=3000))
def test_arbitrary_bytes_pass_unchanged(echo_stream, data):
    assert _echo(echo_stream, data) == data


def test_megabytes_pass_without_the_daemon_dropping_the_client(sandbox):
    # 2 MiB up, then twice that down: the daemon drops a client 256 messages behind, and the
    # window keeps the output in step with what the client has read. (As the session server
    # does, the program reads all its input before it writes: input is not held back.)
    program = 'f=$(mktemp); while IFS= read -r n; do head -c "$n" >"$f"; cat "$f" "$f"; done; rm -f "$f"'
    stream = open_pty_stream(sandbox, ["bash", "-c", program])
    try:
        data = os.urandom(1 << 20) * 2
        stream.write(b"%d\n" % len(data) + data)
        assert _read_exact(stream, 2 * len(data)) == data * 2
        assert _echo(stream, b"after") == b"after"
    finally:
        stream.close()


def test_commands_have_no_terminal_to_read(make_env):
    env = make_env()
    r = env.execute("cat /dev/tty; tty")
    assert r.exit_code != 0 and "not a tty" in r.output
    assert env.execute("echo ok").output == "ok\n"


def test_image_without_bash_is_refused_before_anything_runs(make_env):
    env = make_env(image="alpine:3.20")
    with pytest.raises(EnvironmentUnavailable, match="has no bash"):
        env.execute("true")


# -- faults -----------------------------------------------------------------------------
def _lose_sandbox_mid_command(emu, make_env, how: str):
    env = make_env(timeout=30)
    env.execute("export HERMES_T_KEPT=yes; cd /tmp")
    sb_id = env.sandbox.id
    result: dict[str, object] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            result["r"] = env.execute(f"touch /tmp/started-{env.task_id}; sleep 20")
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            result["e"] = exc
        result["s"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 20
    while not os.path.exists(f"/tmp/started-{env.task_id}") and time.monotonic() < deadline:
        time.sleep(0.02)
    os.unlink(f"/tmp/started-{env.task_id}")
    if how == "stopped":
        emu.force_state(sb_id, "stopped")
    else:
        emu.destroy(emu.sandbox(sb_id))
    t.join(40)
    assert result["s"] < 30 + 5
    if "r" in result:
        assert result["r"].exit_code in (137, 124)
    else:
        assert isinstance(result["e"], EnvironmentUnavailable), result["e"]
    r = env.execute("echo $HERMES_T_KEPT $PWD")
    assert r.output == "yes /tmp\n"
    assert any("new session server" in n for n in r.notes), r.notes
    return env, r


def test_sandbox_stopped_mid_command_is_an_infrastructure_error_then_resumed(emu, make_env):
    env, r = _lose_sandbox_mid_command(emu, make_env, "stopped")
    assert any("restarted stopped sandbox" in n for n in r.notes), r.notes


def test_sandbox_deleted_mid_command_is_an_infrastructure_error_then_recreated(emu, make_env):
    env, r = _lose_sandbox_mid_command(emu, make_env, "deleted")
    assert any("created a new one" in n for n in r.notes), r.notes


def test_background_process_runs_with_the_session_state_and_is_talked_to(make_env):
    from hermes_env_core.processes import ProcessRegistry

    env = make_env()
    env.execute("export HERMES_T_BG=from-session; cd /tmp")
    registry = ProcessRegistry()
    try:
        proc = registry.spawn(env, 'echo "$HERMES_T_BG $PWD"; read -r line; echo "got $line"; exit 4')
        assert proc.wait_for_output("from-session /tmp", timeout=20)
        proc.write("hello\n")
        assert proc.wait(20) == 4
        assert "got hello" in proc.output
    finally:
        registry.close()
    assert env.execute("echo $HERMES_T_BG").output == "from-session\n"  # the session is untouched
