"""Direct mode against the emulator with the real service's latencies: an exit
status that comes late, output that trails the exit status, long requests cut
by a proxy. Each knob's origin is cited in the emulator (tests/emulator)."""

from __future__ import annotations

import time
import uuid

import pytest
from hermes_env_modal import ModalEnvironment

from conftest import load_emulator


def _task() -> str:
    return f"lat-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def late_emu(fresh_modal_emu):
    """The exit status comes 3 s after the exit, from the very first exec."""
    fresh_modal_emu.exit_status_delay = 3.0
    return fresh_modal_emu


def test_late_exit_status_gives_the_commands_own_code(late_emu):
    # The 129 bug: the plugin waited 2 s for the exit status, then reported -1 (-> 129),
    # and environment creation (a login-shell capture) failed the same way.
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        t0 = time.monotonic()
        r = env.execute("echo out; exit 3")
        assert (r.output, r.exit_code) == ("out\n", 3)
        assert time.monotonic() - t0 >= 3.0  # the status really was late
        assert env.execute("true").exit_code == 0
        assert env.execute("kill -9 $$").exit_code == 137  # the status still decides for a signal


def test_exit_status_late_after_start(fresh_modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        fresh_modal_emu.exit_status_delay = 3.0
        assert env.execute("exit 3").exit_code == 3  # was 129
        assert env.execute("true").exit_code == 0  # was 129
        fresh_modal_emu.exit_status_delay = 0.0


def test_output_after_exit_status_is_all_read(fresh_modal_emu):
    fresh_modal_emu.output_delay = 1.0  # the exit status comes first
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        r = env.execute("seq 1 2000; echo last >&2; exit 4")
        assert r.exit_code == 4
        assert r.output.splitlines()[-1] == "last"
        assert r.output.splitlines()[:2000] == [str(i) for i in range(1, 2001)]
        # Helper scripts (run outside the session) read their streams to the end too.
        code, out, _ = env.run_script("seq 1 500")
        assert code == 0 and out.split() == [str(i).encode() for i in range(1, 501)]


def test_long_requests_cut_by_a_proxy(fresh_modal_emu):
    fresh_modal_emu.cut_long_requests_after = 0.5
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        r = env.execute("echo a; sleep 2; echo b; exit 5")
        assert (r.output, r.exit_code) == ("a\nb\n", 5)
    # The wait was cut and re-sent several times (the SDK retries UNAVAILABLE for ever).
    assert fresh_modal_emu.call_count("TaskExecWait") > 3


def test_timeout_with_late_exit_status(late_emu):
    with ModalEnvironment(mode="direct", task_id=_task(), kill_grace_s=1) as env:
        sid = env.sandbox_id
        r = env.execute("echo part; sleep 60", timeout=1)
        assert (r.exit_code, r.timed_out, r.output) == (124, True, "part\n")
        assert env.sandbox_id == sid
        assert env.execute("echo alive").output == "alive\n"


def test_emulator_knobs_are_what_the_sdk_sees(fresh_modal_emu):
    # The knobs themselves, seen through the SDK alone.
    import modal

    fresh_modal_emu.exit_status_delay = 1.0
    fresh_modal_emu.output_delay = 2.0
    app = modal.App.lookup("knobs", create_if_missing=True)
    sb = modal.Sandbox.create(app=app, timeout=60)
    try:
        p = sb.exec("bash", "-c", "echo hi")
        t0 = time.monotonic()
        assert p.wait() == 0
        waited = time.monotonic() - t0
        assert 0.9 <= waited < 1.9
        assert p.poll() == 0
        assert p.stdout.read() == "hi\n"  # came later than the status
        assert time.monotonic() - t0 >= 1.9
    finally:
        sb.terminate()


def test_realistic_profile_is_exported():
    mod = load_emulator()
    assert mod.REALISTIC["output_delay"] > mod.REALISTIC["exit_status_delay"] > 0
