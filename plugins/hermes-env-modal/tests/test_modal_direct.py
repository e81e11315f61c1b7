"""Direct mode beyond the conformance suite: the event loop's life, timeout and
cancel leaving the sandbox up, kills that cannot hit the wrong process, an
ended sandbox replaced, errors that say what to do."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from typing import ClassVar

import hermes_env_modal.direct as direct_mod
import modal
import pytest
from grpclib import Status
from hermes_env_modal import ModalEnvironment
from hermes_env_modal._loop import EventLoopThread
from hermes_env_modal.direct import DirectModalEnvironment

from conftest import load_emulator

from hermes_env_core import ExecResult
from hermes_env_core.errors import (
    BackendError,
    ConfigError,
    EnvironmentClosedError,
    EnvironmentUnavailable,
)
from hermes_env_core.testing import wait_until


def _task() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


class CountingLoop(EventLoopThread):
    instances: ClassVar[list[CountingLoop]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.starts = 0
        self.stops = 0
        CountingLoop.instances.append(self)

    def start(self):
        self.starts += 1
        return super().start()

    def stop(self, timeout: float = 10.0) -> None:
        if not self._stopped:
            self.stops += 1
        super().stop(timeout)


@pytest.fixture
def counting_loop(monkeypatch):
    CountingLoop.instances = []
    monkeypatch.setattr(direct_mod, "EventLoopThread", CountingLoop)
    return CountingLoop.instances


def _assert_once_and_gone(loops: list[CountingLoop]) -> None:
    assert len(loops) == 1
    loop = loops[0]
    assert (loop.starts, loop.stops) == (1, 1)
    assert loop.thread is not None and not loop.thread.is_alive()
    assert loop.loop is not None and loop.loop.is_closed()


# -- the event loop ------------------------------------------------------------------
def test_loop_started_and_stopped_exactly_once(modal_emu, counting_loop):
    env = ModalEnvironment(mode="direct", task_id=_task())
    assert isinstance(env, DirectModalEnvironment)
    assert counting_loop[0].starts == 1 and counting_loop[0].running
    names = [t.name for t in threading.enumerate()]
    assert names.count(counting_loop[0].name) == 1
    assert env.execute("echo one").output == "one\n"
    assert env.execute("echo two").output == "two\n"
    env.close()
    env.close()
    _assert_once_and_gone(counting_loop)
    with pytest.raises(EnvironmentClosedError):
        env.execute("true")


def test_construction_failing_at_sandbox_create_stops_the_loop(fresh_modal_emu, counting_loop):
    fresh_modal_emu.fail_next("SandboxCreateV2", Status.PERMISSION_DENIED, message="no sandboxes for you")
    with pytest.raises(EnvironmentUnavailable, match="no sandboxes for you"):
        ModalEnvironment(mode="direct", task_id=_task())
    _assert_once_and_gone(counting_loop)
    assert not fresh_modal_emu.sandboxes


def test_construction_failing_after_the_sandbox_exists_terminates_it(fresh_modal_emu, counting_loop):
    # The sandbox is created, then the sync mapping is refused: nothing may leak.
    with pytest.raises(ConfigError, match="remote"):
        ModalEnvironment(mode="direct", task_id=_task(), sync=[{"host": "/tmp", "remote": "/"}])
    _assert_once_and_gone(counting_loop)
    (sandbox,) = fresh_modal_emu.sandboxes.values()
    assert sandbox.finished
    assert fresh_modal_emu.call_count("SandboxTerminateV2") == 1


def test_bad_credentials_say_what_to_do(fresh_modal_emu, counting_loop):
    with pytest.raises(ConfigError, match="modal token new"):
        ModalEnvironment(mode="direct", token_id="ak-wrong", token_secret="as-wrong", task_id=_task())
    _assert_once_and_gone(counting_loop)


def test_no_credentials_is_a_config_error(modal_emu, monkeypatch, tmp_path, counting_loop):
    monkeypatch.delenv("MODAL_TOKEN_ID")
    monkeypatch.delenv("MODAL_TOKEN_SECRET")
    with pytest.raises(ConfigError, match="MODAL_TOKEN_ID"):
        DirectModalEnvironment(task_id=_task())
    _assert_once_and_gone(counting_loop)


# -- timeout and cancel keep the sandbox --------------------------------------------
def _exec_procs(emu, sandbox_id: str, needle: str):
    # The command is on the exec's command line or (the core's private script) in its stdin.
    return [
        p for p in emu.sandboxes[sandbox_id].execs.values()
        if needle in " ".join(p.argv) or needle.encode() in p.stdin_received
    ]


def test_timeout_kills_the_command_not_the_sandbox(fresh_modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        env.execute("export KEPT=yes")
        sid = env.sandbox_id
        r = env.execute("echo started; sleep 30; echo never", timeout=1)
        assert r.exit_code == 124 and r.timed_out and r.output == "started\n"
        assert env.sandbox_id == sid and not fresh_modal_emu.sandboxes[sid].finished
        assert fresh_modal_emu.call_count("SandboxTerminateV2") == 0
        (proc,) = _exec_procs(fresh_modal_emu, sid, "sleep 30")
        # ended by our kill, not by an exec deadline (the emulator sees the exit on its own loop)
        assert wait_until(proc.done, 10) and not proc.timed_out
        assert env.execute('echo "$KEPT"').output == "yes\n"


def test_cancel_kills_the_command_not_the_sandbox(fresh_modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        sid = env.sandbox_id
        cancel = threading.Event()
        seen = threading.Event()

        def on_output(text: str) -> None:
            if "go" in text:
                seen.set()

        threading.Thread(target=lambda: seen.wait(30) and cancel.set(), daemon=True).start()
        r = env.execute("echo go; sleep 60", cancel=cancel, on_output=on_output, timeout=90)
        assert r.exit_code == 130 and r.interrupted and r.output == "go\n"
        assert r.duration_s < 15
        assert not fresh_modal_emu.sandboxes[sid].finished
        (proc,) = _exec_procs(fresh_modal_emu, sid, "sleep 60")
        assert wait_until(proc.done, 10)  # the emulator sees the exit on its own loop
        assert env.execute("echo alive").output == "alive\n"


def test_a_stale_pidfile_never_points_the_kill_at_another_process(modal_emu, tmp_path):
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        victim = tmp_path / "stale.pid"
        victim.write_text(str(os.getpid()))  # this test process: alive, but not our command
        assert env._find_pids(str(victim), "0123456789abcdef") == ()


def test_output_streams_while_the_command_runs(modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        seen: list[str] = []
        first = threading.Event()

        def on_output(text: str) -> None:
            seen.append(text)
            first.set()

        flag = f"/tmp/hermes-modal-flag-{uuid.uuid4().hex}"
        # The command waits for a file the test creates only after seeing "first".
        t = threading.Thread(
            target=lambda: first.wait(20) and open(flag, "w").close(), daemon=True
        )
        t.start()
        r = env.execute(f"echo first; while [ ! -e {flag} ]; do sleep 0.05; done; echo second",
                        on_output=on_output, timeout=30)
        t.join()
        os.unlink(flag)
        assert r.output == "first\nsecond\n" and r.exit_code == 0
        assert seen[0].startswith("first")


def test_binary_stdout_of_a_helper_command_is_exact(modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        data = bytes(range(256)) * 300
        code, out, _ = env.run_script("cat", stdin=data)
        assert code == 0 and out == data


def test_a_script_over_the_sdk_argument_limit_runs(modal_emu):
    # The SDK refuses exec arguments over 2**16 characters: the server reads a command
    # from its stream, whatever its size.
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        payload = "y" * 150_000
        big = env.execute(f"v='{payload}'; echo ${{#v}}; no_such_cmd_hermes_t")
        assert big.exit_code == 127
        assert big.output.splitlines()[0] == "150000"
        assert big.output.splitlines()[-1].endswith("no_such_cmd_hermes_t: command not found")
        assert "__hermes" not in big.output


def test_an_ended_sandbox_is_replaced_and_the_shell_state_kept(modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        env.execute("export CARRIED=over; cd /tmp")
        old = env.sandbox_id
        modal.Sandbox.from_id(old).terminate()
        assert wait_until(lambda: modal_emu.sandboxes[old].finished, 10)
        r = env.execute('echo "$CARRIED"; pwd')
        assert r.output == "over\n/tmp\n"
        assert env.sandbox_id != old
        assert any("had ended" in n and old in n for n in r.notes)


def test_sandbox_terminated_mid_command(fresh_modal_emu):
    # With the service's latencies: the command gets an infrastructure error (or 124/137)
    # within its timeout + 5 s, and the next one runs on a new server, in a new sandbox,
    # with the checkpointed state and notes saying so.
    for knob, value in load_emulator().REALISTIC.items():
        setattr(fresh_modal_emu, knob, value)
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        env.execute("export HERMES_T_F=kept; cd /tmp")
        old = env.sandbox_id
        seen = threading.Event()
        out: dict[str, object] = {}

        def run() -> None:
            t0 = time.monotonic()
            try:
                out["result"] = env.execute(
                    "echo go; sleep 60", timeout=10, on_output=lambda text: "go" in text and seen.set()
                )
            except BaseException as exc:  # noqa: BLE001 - inspected below
                out["error"] = exc
            out["took"] = time.monotonic() - t0

        t = threading.Thread(target=run)
        t.start()
        assert seen.wait(30)
        modal.Sandbox.from_id(old).terminate()
        t.join(30)
        assert not t.is_alive() and out["took"] < 10 + 5, out
        result = out.get("result")
        assert isinstance(out.get("error"), (BackendError, EnvironmentUnavailable)) or (
            isinstance(result, ExecResult) and result.exit_code in (124, 137)
        ), out
        again = env.execute('echo "$HERMES_T_F"; pwd')
        assert again.output == "kept\n/tmp\n"
        assert any("new session server" in n for n in again.notes), again.notes
        assert any("had ended" in n and old in n for n in again.notes), again.notes
        assert env.sandbox_id != old and env.session_mode == "server"


def test_ended_sandbox_not_replaced_when_recreate_is_off(modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task(), recreate=False) as env:
        modal.Sandbox.from_id(env.sandbox_id).terminate()
        with pytest.raises(EnvironmentUnavailable, match="could not start the command"):
            env.execute("true")


def test_sandbox_options_reach_modal(fresh_modal_emu):
    with ModalEnvironment(
        mode="direct", task_id=_task(), image="python:3.12-slim", cpu=0.5, memory="256m",
        sandbox_timeout=600, workdir="/workspace", env={"FROM_CONFIG": "1"},
    ) as env:
        state = fresh_modal_emu.sandboxes[env.sandbox_id]
        assert (state.timeout_secs, state.milli_cpu, state.memory_mb, state.workdir) == (600, 500, 256, "/workspace")
        assert env.execute('echo "$FROM_CONFIG"').output == "1\n"
        assert fresh_modal_emu.apps  # App.lookup(create_if_missing=True) made the app


def test_concurrent_large_outputs_do_not_stall_each_other(modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        results: dict[int, str] = {}

        def run(i: int) -> None:
            r = env.execute(f"head -c 3000000 /dev/zero | tr '\\0' {chr(97 + i)} | sha256sum")
            results[i] = r.output.split()[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(3):
            assert results[i] == hashlib.sha256(chr(97 + i).encode() * 3000000).hexdigest()
