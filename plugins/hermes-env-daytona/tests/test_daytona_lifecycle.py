"""One sandbox per task id: created, resumed by name, started again, stopped or deleted."""

from __future__ import annotations

import os
import threading

import pytest
from daytona import CreateSandboxFromSnapshotParams, Daytona, DaytonaConfig

from hermes_env_core.testing import wait_until


def _only(emu):
    (record,) = emu.sandboxes.values()
    return record


def _sdk_client(emu):
    return Daytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key))


def test_created_on_first_use_with_name_labels_and_auto_stop(emu, make_env, task_id):
    env = make_env(labels={"team": "hermes"}, auto_stop_interval=0)
    assert emu.sandboxes == {}  # nothing is created until a command needs it
    assert env.execute("echo hi").output == "hi\n"
    record = _only(emu)
    assert record.name == f"hermes-{task_id}" == env.sandbox_name
    assert record.labels["team"] == "hermes"
    assert record.labels["hermes-env-task"] == task_id
    assert record.create_request["autoStopInterval"] == 0
    assert record.state == "started"


def test_sandbox_name_option(emu, make_env):
    env = make_env(sandbox_name="my-box")
    env.execute("true")
    assert _only(emu).name == "my-box"


def test_image_and_capped_resources(emu, make_env):
    env = make_env(image="python:3.12-slim", cpu=16, memory="2g", disk=50)
    r = env.execute("true")
    record = _only(emu)
    assert "FROM python:3.12-slim" in record.dockerfile
    assert (record.cpu, record.memory, record.disk) == (4, 2, 10)
    assert any("cpu 16 is over the per-sandbox limit; using 4" in n for n in r.notes)
    assert any("disk 50 GiB" in n for n in r.notes)


def test_snapshot_option(emu, make_env):
    make_env(snapshot="my-snapshot").execute("true")
    assert _only(emu).create_request["snapshot"] == "my-snapshot"


@pytest.mark.parametrize("archived", [False, True])
def test_stopped_or_archived_sandbox_of_that_name_is_resumed(emu, make_env, task_id, archived):
    first = make_env()
    first.execute("echo kept > marker.txt")
    sandbox_id = first.sandbox.id
    first.close()  # persistent (the default): stopped, not deleted
    assert emu.sandboxes[sandbox_id].state == "stopped"
    if archived:
        _sdk_client(emu).get(sandbox_id).archive()
        assert emu.sandboxes[sandbox_id].state == "archived"

    second = make_env(task_id=task_id)
    r = second.execute("cat marker.txt")
    assert r.output == "kept\n"
    assert second.sandbox.id == sandbox_id
    assert len(emu.sandboxes) == 1
    assert any(("archived" if archived else "stopped") in n and "resumed" in n for n in r.notes)


def test_running_sandbox_of_that_name_is_reused(emu, make_env, task_id):
    client = _sdk_client(emu)
    existing = client.create(CreateSandboxFromSnapshotParams(name=f"hermes-{task_id}"))
    env = make_env()
    r = env.execute("true")
    assert env.sandbox.id == existing.id and len(emu.sandboxes) == 1
    assert any("resumed running sandbox" in n for n in r.notes)


def test_auto_stop_interval_applied_to_a_resumed_sandbox(emu, make_env, task_id):
    _sdk_client(emu).create(CreateSandboxFromSnapshotParams(name=f"hermes-{task_id}", auto_stop_interval=15))
    make_env(auto_stop_interval=60).execute("true")
    assert _only(emu).auto_stop_interval == 60


@pytest.mark.parametrize("events", [True, False], ids=["state-event", "no-events"])
def test_sandbox_stopped_between_commands_is_started_again(emu, make_env, events):
    if not events:
        emu.events.enabled = False  # the SDK only learns of the stop when exec fails
    env = make_env()
    env.execute("export HERMES_T_KEEP=1; cd /tmp")
    sandbox_id = env.sandbox.id
    if events:
        assert emu.events.wait_connected(1, timeout=10)
    _sdk_client(emu).get(sandbox_id).stop()
    assert emu.sandboxes[sandbox_id].state == "stopped"
    if events:
        assert wait_until(lambda: str(env._sandbox.state.value) == "stopped", 10)
    r = env.execute('echo "$HERMES_T_KEEP"; pwd')
    assert r.exit_code == 0 and r.output == "1\n/tmp\n"
    assert emu.sandboxes[sandbox_id].state == "started"
    assert any("restarted stopped sandbox" in n for n in r.notes)


@pytest.mark.parametrize("events", [True, False], ids=["state events", "no state events"])
def test_sandbox_deleted_behind_our_back_is_recreated_with_the_session(emu, make_env, events):
    emu.events.enabled = events  # without them the SDK's cached state still says 'started'
    env = make_env()
    # /tmp: the emulator gives every sandbox its own home path, a real service the same one.
    env.execute("export HERMES_T_KEEP=yes; cd /tmp")
    old = env.sandbox.id
    _sdk_client(emu).delete(_sdk_client(emu).get(old))
    r = env.execute('echo "$HERMES_T_KEEP"; pwd')
    assert r.output == "yes\n/tmp\n"
    assert env.sandbox.id != old and old not in emu.sandboxes
    assert any("was deleted; created a new one" in n for n in r.notes)


def test_cleanup_stops_a_persistent_sandbox(emu, make_env):
    env = make_env()
    env.execute("true")
    sandbox_id = env.sandbox.id
    env.close()
    assert emu.sandboxes[sandbox_id].state == "stopped"


def test_cleanup_deletes_a_non_persistent_sandbox(emu, make_env):
    env = make_env(persistent=False)
    env.execute("true")
    sandbox_id = env.sandbox.id
    env.close()
    assert wait_until(lambda: sandbox_id not in emu.sandboxes, 10)


def test_cleanup_without_a_sandbox_makes_no_request(emu, make_env):
    env = make_env()
    before = len(emu.requests)
    env.close()
    assert emu.sandboxes == {} and len(emu.requests) == before


def test_timeout_ends_the_command_not_the_sandbox(emu, make_env):
    env = make_env()
    bg = env.execute("sleep 300 >/dev/null 2>&1 & echo $!").output.strip()
    r = env.execute("echo start; sleep 30", timeout=1)
    assert r.timed_out and r.output == "start\n"
    record = _only(emu)
    assert record.state == "started"
    # A background process of an earlier command still runs: only the timed-out tree was killed.
    assert env.execute(f"kill -0 {bg} && echo alive").output == "alive\n"
    env.execute(f"kill {bg}")


def test_cancel_ends_the_command_not_the_sandbox(emu, make_env):
    env = make_env()
    cancel = threading.Event()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    r = env.execute("sleep 30", cancel=cancel)
    timer.join()
    assert r.interrupted and r.exit_code == 130
    assert _only(emu).state == "started"
    assert env.execute("echo still").output == "still\n"


def test_large_state_and_scripts_go_through_the_stream(emu, make_env):
    env = make_env()
    env.execute("HERMES_T_BIG=$(head -c 200000 /dev/zero | tr '\\0' x)")
    big = "echo " + "y" * 300_000 + " >/dev/null; " + 'echo "${#HERMES_T_BIG}"'
    assert env.execute(big).output == "200000\n"
    assert not [r for r in emu.requests if r.path.endswith("/files/bulk-upload")]


def test_commands_run_under_bash_and_get_configured_env(make_env):
    env = make_env(env={"HERMES_T_GIVEN": "v w"})
    r = env.execute('echo "$BASH_VERSION" "$HERMES_T_GIVEN"')
    assert r.output.split(" ", 1)[1] == "v w\n" and r.output[0].isdigit()


def test_live_output_arrives_while_the_command_runs(make_env):
    env = make_env()
    seen = threading.Event()
    chunks: list[str] = []

    def on_output(text: str) -> None:
        chunks.append(text)
        if "first" in text:
            seen.set()

    done = threading.Event()

    def run():
        env.execute("echo first; while [ ! -e /tmp/$HERMES_T_GO ]; do sleep 0.05; done; echo second", on_output=on_output)
        done.set()

    env.execute(f"export HERMES_T_GO=go-{env.task_id}")
    t = threading.Thread(target=run)
    t.start()
    assert seen.wait(20), "no live output"
    assert not done.is_set()
    # Commands on one environment take turns, as in one shell: the file comes from outside the session.
    env.run_script(f"touch /tmp/go-{env.task_id}", "a helper")
    t.join(30)
    assert "".join(chunks) == "first\nsecond\n"
    env.execute(f"rm -f /tmp/go-{env.task_id}")


def test_cleanup_removes_the_session_files(make_env, task_id):
    import glob

    env = make_env()
    env.execute("true")
    # The emulator's sandboxes share this machine's /tmp: the session keeps its files in a
    # private directory there (or, with an older core, beside each other in /tmp itself).
    state_dir = env.session.state_dir
    private = state_dir != "/tmp"
    if private:
        assert os.path.isdir(state_dir)
    else:
        assert glob.glob(f"/tmp/.hermes-{task_id}-*")
    env.close()
    if private:
        assert not os.path.exists(state_dir)
    else:
        assert glob.glob(f"/tmp/.hermes-{task_id}-*") == []
