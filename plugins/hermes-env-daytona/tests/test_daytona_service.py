"""The backend against what the real service does: late exit statuses, lagging output,
proxies that cut long requests, sandboxes that stop, archive and pause on their own.

Each behaviour is a knob of the emulator (see ``emulator/emulator.py``), switched on here.
"""

from __future__ import annotations

import threading
import time

import pytest

from hermes_env_daytona import _sdk
from daytona import Daytona, DaytonaTimeoutError

# -- exit status and output -------------------------------------------------------------------------


def test_commands_do_not_go_through_the_daemons_session_commands(emu, make_env):
    # The session server reports each command's status itself, over its PTY stream: a
    # daemon slow to publish session command statuses does not slow commands down.
    env = make_env()
    env.execute("true")
    emu.exit_status_delay = 1.5
    t0 = time.monotonic()
    r = env.execute("echo hello; exit 3")
    assert (r.output, r.exit_code) == ("hello\n", 3)
    r = env.execute("true")
    assert r.exit_code == 0
    assert time.monotonic() - t0 < 1.5
    assert not [q for q in emu.requests if "/process/session" in q.path]


def test_output_after_the_exit_status_is_not_lost(emu, make_env):
    env = make_env()
    env.execute("true")
    emu.output_after_exit = 1.0  # the last 256 bytes of a command's logs lag behind its exit status
    r = env.execute("seq 1 500; exit 4")
    assert r.output == "".join(f"{i}\n" for i in range(1, 501))
    assert r.exit_code == 4
    # Session state is recorded in the same lagging tail: it must survive too.
    env.execute("cd /tmp; export LATE=yes")
    assert env.execute("echo $PWD $LATE").output == "/tmp yes\n"


def test_late_status_and_lagging_output_together_with_live_output(emu, make_env):
    env = make_env()
    env.execute("true")
    emu.exit_status_delay = 0.5
    emu.output_after_exit = 0.5
    seen: list[str] = []
    r = env.execute("echo a; sleep 0.3; echo b; exit 7", on_output=seen.append)
    assert (r.output, r.exit_code) == ("a\nb\n", 7)
    assert "".join(seen) == "a\nb\n"


def test_background_child_output_after_the_end_is_not_passed_on(make_env):
    env = make_env()
    r = env.execute("(sleep 0.5; echo late) & echo now")
    assert r.output == "now\n"


# -- long commands never ride on one long request ----------------------------------------------------


def test_emulated_proxy_cuts_a_long_request(emu, make_env):
    env = make_env()
    sb = env.sandbox
    emu.proxy_timeout = 0.5
    with pytest.raises(DaytonaTimeoutError) as info:
        sb.process.exec("sleep 1.5; echo done")
    assert info.value.status_code == 504
    assert emu.cut_requests == 1


def test_long_command_survives_a_proxy_that_cuts_long_requests(emu, make_env):
    env = make_env()
    env.execute("true")
    emu.proxy_timeout = 0.5
    r = env.execute("echo ran >> runs; sleep 2; echo done")
    assert (r.output, r.exit_code) == ("done\n", 0)
    assert emu.cut_requests == 0
    assert env.execute("cat runs").output == "ran\n"  # once: no request was cut and sent again


def test_timeout_of_a_long_command_keeps_the_sandbox_and_session(emu, make_env):
    env = make_env()
    env.execute("export KEEP=1")
    emu.proxy_timeout = 0.5
    r = env.execute("sleep 30", timeout=1.5)
    assert r.timed_out and r.exit_code == 124
    assert env.execute("echo $KEEP").output == "1\n"


# -- sandboxes that change state by themselves -------------------------------------------------------


def test_auto_stopped_sandbox_is_started_again_with_the_session(emu, make_env):
    env = make_env(auto_stop_interval=1)
    env.execute("cd /tmp && export STAY=here")
    sid = env.sandbox.id
    emu.minute_s = 0.3  # one of the service's minutes: idle that long, it stops
    assert emu.wait_state(sid, "stopped", timeout=10) == "stopped"
    r = env.execute("echo $PWD $STAY")
    assert r.output == "/tmp here\n"
    assert any("restarted stopped sandbox" in n for n in r.notes)
    assert env.sandbox.id == sid


def test_auto_archived_sandbox_is_restored(emu, make_env):
    env = make_env(auto_stop_interval=1)
    env.execute("echo kept > marker")
    sid = env.sandbox.id
    emu.sandbox(sid).auto_archive_interval = 1
    emu.minute_s = 0.3
    assert emu.wait_state(sid, "archived", timeout=10) == "archived"
    r = env.execute("cat marker")
    assert r.output == "kept\n"
    assert any("restarted archived sandbox" in n for n in r.notes)


@pytest.mark.parametrize(("via", "final"), [("archiving", "archived"), ("pausing", "paused"), ("stopping", "stopped")])
def test_sandbox_going_down_is_waited_for_then_started(emu, make_env, via, final):
    env = make_env(start_timeout=20)
    env.execute("export X=1")
    sid = env.sandbox.id
    emu.transition_delays[via] = 1.0
    emu.transition(emu.sandbox(sid), via=via, final=final)
    deadline = time.monotonic() + 5
    while _sdk.state_of(env._sandbox) != via and time.monotonic() < deadline:  # the SDK's pushed state event
        time.sleep(0.01)
    t0 = time.monotonic()
    r = env.execute("echo $X")
    assert r.output == "1\n"
    assert time.monotonic() - t0 < 15  # settled and started, not the SDK waiting for 'stopped' until timeout
    assert any(f"restarted {final} sandbox" in n for n in r.notes), r.notes
    # Through the state it passed on the way back up.
    assert emu.sandbox(sid).state == "started"


def test_resume_by_name_of_an_archiving_sandbox(emu, make_env, task_id):
    first = make_env()
    first.execute("echo one > f")
    sid = first.sandbox.id
    first.close()  # persistent: stopped
    emu.transition_delays["archiving"] = 1.0
    client = Daytona()
    client.get(sid).archive()
    assert emu.sandbox(sid).state == "archiving"
    second = make_env(start_timeout=20)
    r = second.execute("cat f")
    assert r.output == "one\n"
    assert any("resumed archived sandbox" in n for n in r.notes)


def test_sandbox_stopped_while_a_command_runs_is_an_error_not_a_status(emu, make_env):
    from hermes_env_core.errors import BackendError

    env = make_env()
    env.execute("true")
    sid = env.sandbox.id

    marker = emu.sandbox(sid).root / "running"

    def stop_once_running() -> None:
        for _ in range(500):  # bounded: until the command has started (at most ~10 s)
            if marker.exists():
                break
            time.sleep(0.02)
        emu.force_state(sid, "stopped")

    t = threading.Thread(target=stop_once_running)
    t.start()
    with pytest.raises(BackendError, match="session server was lost during the command"):
        env.execute("touch running; sleep 5")
    t.join()
    # The next command brings it back.
    assert env.execute("echo back").output == "back\n"
