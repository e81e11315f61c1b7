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
    # and environment creation failed the same way. On the session server a command's
    # status comes with its report: Modal's late exit status is not waited for.
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        assert env.execute("true").exit_code == 0
        t0 = time.monotonic()
        r = env.execute("echo out; false")
        assert (r.output, r.exit_code) == ("out\n", 1)
        assert time.monotonic() - t0 < 3.0
        assert env.execute("echo out; exit 3").exit_code == 3
        # The server's own exec killed: its late exit status still decides (137, signal 9).
        r = env.execute("kill -9 $$")
        assert r.exit_code == 137 and any("signal 9" in n for n in r.notes), r
        assert env.execute("echo alive").output == "alive\n"


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
    # The session server's output stream was cut and resumed at its offset several
    # times (the SDK retries UNAVAILABLE for ever).
    assert fresh_modal_emu.call_count("TaskExecStdioRead") > 3


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


# -- a lost sandbox, images, bounds ----------------------------------------------------
def test_service_error_with_an_ended_sandbox_is_a_lost_sandbox(fresh_modal_emu):
    # The SDK's retries exhausted (ServiceError) while the sandbox polls as ended:
    # what a sandbox that died with its worker looks like. The SDK itself counts
    # NotFoundError/ServiceError/ConnectionError as "sandbox unavailable"
    # (modal/_utils/sandbox_fs_utils.py).
    from grpclib import Status

    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        env.execute("export KEEP=yes")
        old = env.sandbox_id
        fresh_modal_emu.run(fresh_modal_emu._store.finish(fresh_modal_emu.sandboxes[old], 3))
        fresh_modal_emu.fail_next("TaskExecStart", Status.UNAVAILABLE, count=11)
        r = env.execute('echo "$KEEP"')
        assert r.output == "yes\n" and env.sandbox_id != old
        assert any("had ended" in n for n in r.notes)


def test_service_error_with_a_live_sandbox_is_an_error_not_a_new_sandbox(fresh_modal_emu):
    from grpclib import Status

    from hermes_env_core.errors import EnvironmentUnavailable

    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        old = env.sandbox_id
        fresh_modal_emu.fail_next("TaskExecStart", Status.UNAVAILABLE, count=11)
        with pytest.raises(EnvironmentUnavailable, match="ServiceError"):
            env.execute("true")
        assert env.sandbox_id == old and env.execute("echo ok").output == "ok\n"


def test_an_image_without_bash_is_refused_with_what_it_lacks(fresh_modal_emu):
    from hermes_env_core.errors import ConfigError

    fresh_modal_emu.image_lacks = {"bash"}
    with pytest.raises(ConfigError, match="alpine:3.20.*no bash.*bash >= 4.4"):
        ModalEnvironment(mode="direct", task_id=_task(), image="alpine:3.20")
    (sb,) = fresh_modal_emu.sandboxes.values()
    assert sb.finished  # terminated, not left running


def test_an_image_without_tar_is_refused_only_when_files_are_synced(fresh_modal_emu, tmp_path):
    from hermes_env_core.errors import ConfigError

    fresh_modal_emu.image_lacks = {"tar"}
    with ModalEnvironment(mode="direct", task_id=_task()) as env:
        assert env.execute("echo fine").output == "fine\n"
    with pytest.raises(ConfigError, match="no tar \\(needed by file sync\\)"):
        ModalEnvironment(mode="direct", task_id=_task(), sync=[{"host": str(tmp_path), "remote": "w"}])


def test_idle_timeout_is_passed_and_an_idled_sandbox_replaced(fresh_modal_emu):
    with ModalEnvironment(mode="direct", task_id=_task(), idle_timeout=1) as env:
        env.execute("cd /tmp")
        old = env.sandbox_id
        sb = fresh_modal_emu.sandboxes[old]
        assert sb.idle_timeout_secs == 1
        deadline = time.monotonic() + 10
        while not sb.finished and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded wait for the emulator's idle watcher
        assert sb.finished
        r = env.execute("pwd")
        assert r.output == "/tmp\n" and env.sandbox_id != old
        assert any("idle_timeout" in n for n in r.notes)


def test_sandbox_timeout_is_capped_at_the_services_24_hours():
    from hermes_env_modal import ModalConfig
    from pydantic import ValidationError

    assert ModalConfig(sandbox_timeout=24 * 3600).sandbox_timeout == 86400
    with pytest.raises(ValidationError, match="sandbox_timeout") as info:
        ModalConfig(sandbox_timeout=24 * 3600 + 1)
    assert "86400" in str(info.value)


def test_startup_bound_is_configurable(fresh_modal_emu):
    from hermes_env_core.errors import EnvironmentUnavailable

    fresh_modal_emu.rpc_latency = 1.0
    t0 = time.monotonic()
    with pytest.raises(EnvironmentUnavailable, match="in time"):
        ModalEnvironment(mode="direct", task_id=_task(), start_timeout=0.5)
    assert time.monotonic() - t0 < 30
    fresh_modal_emu.rpc_latency = 0.0
