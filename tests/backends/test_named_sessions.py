"""Named sessions (issue 24 §1): one session server shared by separate processes, on local, docker and ssh."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_env_core import BackendRegistry, BackendSpec, create_environment
from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.environment.named import SessionBusyError
from hermes_env_core.environment.named_store import SessionStore, UnknownSessionError
from hermes_env_core.errors import UnsupportedOperation
from hermes_env_core.factory import EnvironmentFactory
from hermes_env_core.plugins import builtin, hookimpl
from hermes_env_core.testing import wait_until


@pytest.fixture
def state_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    return home


def cli(state_home: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_STATE_HOME": str(state_home)}
    return subprocess.run(
        [sys.executable, "-m", "hermes_env_core.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def record(state_home: Path, name: str) -> dict:
    return json.loads((state_home / "hermes-env" / "sessions" / f"{name}.json").read_text())


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


SETUP = "cd /usr; export NAMED_A='a b'; f() { echo \"fn:$1\"; }; sleep 300 & echo started"
CHECK = "pwd; echo \"A=$NAMED_A\"; f x; jobs | grep -c 'sleep 300'"
EXPECT = "/usr\nA=a b\nfn:x\n1\n"


def _shared_state_across_processes(state_home: Path, backend_args: list[str]) -> None:
    first = cli(state_home, "run", *backend_args, "--session", "s1", SETUP)
    assert first.returncode == 0, first.stderr
    assert first.stdout == "started\n"
    second = cli(state_home, "run", "--session", "s1", CHECK)
    assert second.returncode == 0, second.stderr
    assert second.stdout == EXPECT
    assert "shell state starts fresh" not in second.stderr
    listing = cli(state_home, "sessions")
    assert listing.returncode == 0
    row = [line for line in listing.stdout.splitlines() if line.startswith("s1 ")]
    assert row and row[0].split()[1] == (backend_args[1] if backend_args else "local")


# -- local ---------------------------------------------------------------------------------


def test_local_two_processes_share_one_session_and_rm_ends_it(state_home):
    _shared_state_across_processes(state_home, [])
    rec = record(state_home, "s1")
    pid = rec["server_pid"]
    assert pid_alive(pid)
    rm = cli(state_home, "sessions", "rm", "s1")
    assert rm.returncode == 0, rm.stderr
    assert wait_until(lambda: not pid_alive(pid), 10.0)
    assert wait_until(lambda: not os.path.exists(rec["private_dir"]), 10.0)
    assert "s1" not in cli(state_home, "sessions").stdout
    again = cli(state_home, "run", "--session", "s1", 'echo "A=$NAMED_A"; pwd')
    assert again.stdout.startswith("A=\n")  # a new session, nothing carried over


def test_concurrent_attaches_neither_tear_state_nor_lose_a_command(state_home):
    assert cli(state_home, "run", "--session", "c", "N=0").returncode == 0
    runs = 6
    with ThreadPoolExecutor(runs) as pool:
        results = list(pool.map(
            lambda i: cli(state_home, "run", "--session", "c", 'for i in 1 2 3; do N=$((N+1)); done; echo $N'),
            range(runs),
        ))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    seen = sorted(int(r.stdout) for r in results)
    assert seen == [3 * (i + 1) for i in range(runs)]  # each saw all before it, none interleaved
    final = cli(state_home, "run", "--session", "c", "echo $N")
    assert final.stdout == f"{3 * runs}\n"
    cli(state_home, "sessions", "rm", "c")


def test_a_second_attach_waits_for_the_running_command_or_fails_with_no_wait(state_home, tmp_path):
    env = create_environment("local", session="busy")
    try:
        env.execute("export HELD=1")
        started, gate = tmp_path / "started", tmp_path / "gate"
        results = []
        first = threading.Thread(target=lambda: results.append(env.execute(
            f"touch {started}; while [ ! -e {gate} ]; do sleep 0.02; done; HELD=2; echo done"
        )))
        first.start()
        assert wait_until(started.exists, 10.0)
        r = cli(state_home, "run", "--session", "busy", "--no-wait", "echo $HELD")
        assert r.returncode == 125
        assert "session 'busy' is in use by another process" in r.stderr
        with pytest.raises(SessionBusyError, match="in use"):
            create_environment(session="busy", wait=False)
        waiting = subprocess.Popen(
            [sys.executable, "-m", "hermes_env_core.cli", "run", "--session", "busy", "echo $HELD"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "XDG_STATE_HOME": str(state_home)},
        )
        gate.touch()
        out, err = waiting.communicate(timeout=60)
        assert out == "2\n", err  # it ran after the first command ended, in the state that command left
        first.join(30)
        assert results[0].output == "done\n"
        assert env.execute("echo $HELD").output == "2\n"  # the first environment is still attached
    finally:
        env.close()


def test_python_detach_leaves_it_running_and_close_ends_it(state_home):
    env = create_environment("local", session="py")
    env.execute("cd /etc && x=41")
    env.detach()
    assert env.closed
    r = cli(state_home, "run", "--session", "py", "echo $((x+1)) $PWD")
    assert r.stdout == "42 /etc\n"
    env = create_environment(session="py")
    pid = record(state_home, "py")["server_pid"]
    assert env.execute("echo $x").output == "41\n"
    # An attached server takes stdin and is stopped on a timeout like one it booted.
    assert env.execute("wc -c", stdin=b"abc\n").output == "4\n"
    assert env.execute("sleep 30", timeout=0.5).timed_out
    assert env.execute("echo $x").output == "41\n"
    # the timeout ended that server; its successor is in the record once the environment lets go
    assert wait_until(lambda: record(state_home, "py")["server_pid"] != pid, 10.0)
    pid = record(state_home, "py")["server_pid"]
    assert pid_alive(pid)
    env.close()
    assert wait_until(lambda: not pid_alive(pid), 10.0)
    assert SessionStore().names() == []


def test_close_while_the_environment_lets_go_of_its_server_still_ends_it(state_home, monkeypatch):
    """After a command the environment lets go of the session's server (a timer); a close()
    that comes meanwhile must attach again and end it, not leave it running with no record."""
    from hermes_env_core.environment import named

    monkeypatch.setattr(named, "_RELEASE_AFTER_S", 0.0)  # the let-go runs as close() begins
    for round_ in range(6):
        env = create_environment("local", session=f"race{round_}")
        assert env.execute("echo hi").output == "hi\n"
        pid = record(state_home, f"race{round_}")["server_pid"]
        env.close()
        assert wait_until(lambda: not pid_alive(pid), 10.0), f"round {round_}: the server outlived close()"
    assert SessionStore().names() == []


def test_a_command_that_ends_the_shell_leaves_its_state_to_the_next_call(state_home):
    r = cli(state_home, "run", "--session", "ex", "cd /var; X=5; exit 3")
    assert r.returncode == 3, r.stderr
    r = cli(state_home, "run", "--session", "ex", "echo $X $PWD")
    assert r.stdout == "5 /var\n", r.stderr
    cli(state_home, "sessions", "rm", "ex")


def test_unknown_session_names_the_ones_that_exist(state_home):
    create_environment("local", session="alpha").detach()
    r = cli(state_home, "sessions", "rm", "nope")
    assert r.returncode == 2
    assert "no session named 'nope'; the sessions are: alpha" in r.stderr
    with pytest.raises(UnknownSessionError, match="the sessions are: alpha"):
        create_environment(session="nope", restore=True)
    with pytest.raises(Exception, match="invalid session name"):
        create_environment(session="../x")
    cli(state_home, "sessions", "rm", "alpha")


def test_idle_timeout_ends_the_session_and_attach_says_so(state_home):
    r = cli(state_home, "run", "--session", "idle", "--session-idle-timeout", "1", "export KEEP=1")
    assert r.returncode == 0, r.stderr
    pid = record(state_home, "idle")["server_pid"]
    assert wait_until(lambda: not pid_alive(pid), 20.0)
    r = cli(state_home, "run", "--session", "idle", "echo $KEEP")
    assert r.returncode == 125
    assert "was lost" in r.stderr and "session_idle_timeout=1s" in r.stderr and "--restore" in r.stderr
    r = cli(state_home, "run", "--session", "idle", "--restore", "echo $KEEP")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "1\n"
    cli(state_home, "sessions", "rm", "idle")


class _NoNamed(LocalEnvironment):
    name = "nonamed"
    named_sessions = False


class _Plugin:
    @hookimpl
    def hermes_env_backends(self):
        return [BackendSpec(name="nonamed", target=f"{__name__}:_NoNamed",
                            config_model="hermes_env_core.backends.local:LocalConfig")]


def test_a_backend_without_the_capability_is_refused_by_name(state_home):
    registry = BackendRegistry(entry_points=False)
    registry.register(builtin, name="core", distribution="hermes-env-core")
    registry.register(_Plugin(), distribution="nonamed")
    with pytest.raises(UnsupportedOperation, match="backend 'nonamed' does not support named sessions"):
        EnvironmentFactory(registry).create("nonamed", session="x")


# -- docker --------------------------------------------------------------------------------


@pytest.mark.docker
def test_docker_shared_state_and_a_removed_container_is_reported(state_home, docker_client, docker_image):
    args = ["--env", "docker", "-o", f"image={docker_image}", "-o", "network_mode=none"]
    _shared_state_across_processes(state_home, args)
    task = record(state_home, "s1")["task_id"]
    name = f"hermes-env-{task}"
    docker_client.containers.get(name).remove(force=True)
    r = cli(state_home, "run", "--session", "s1", "echo $NAMED_A")
    assert r.returncode == 125
    assert "session 's1' on docker" in r.stderr and "was removed" in r.stderr and "--restore" in r.stderr
    r = cli(state_home, "run", "--session", "s1", "--restore", 'echo "$NAMED_A"; pwd')
    assert r.returncode == 0, r.stderr
    assert r.stdout == "a b\n/usr\n"
    rm = cli(state_home, "sessions", "rm", "s1")
    assert rm.returncode == 0, rm.stderr
    assert not [c for c in docker_client.api.containers(all=True, filters={"name": name}) if f"/{name}" in c["Names"]]


# -- ssh -----------------------------------------------------------------------------------


@pytest.mark.ssh
def test_ssh_two_processes_share_one_session(state_home, sshd_server, tmp_path):
    args = [
        "--env", "ssh", "-o", f"host={sshd_server.host}", "-o", f"port={sshd_server.port}",
        "-o", f"user={sshd_server.user}", "-o", f"key_path={sshd_server.client_key_path}",
        "-o", "use_agent=false", "-o", "look_for_keys=false", "-o", f"known_hosts={tmp_path / 'known_hosts'}",
    ]
    _shared_state_across_processes(state_home, args)
    rec = record(state_home, "s1")
    assert rec["target"] and rec["option_strings"]["host"] == sshd_server.host
    probe = cli(state_home, "run", *args, f"kill -0 {rec['server_pid']} && echo alive")
    assert probe.stdout == "alive\n"
    rm = cli(state_home, "sessions", "rm", "s1")
    assert rm.returncode == 0, rm.stderr

    def gone() -> bool:
        return cli(state_home, "run", *args, f"kill -0 {rec['server_pid']} 2>/dev/null || echo gone").stdout == "gone\n"

    assert wait_until(gone, 20.0, 0.5)


def test_shell_attaches_the_same_session(state_home):
    sh = subprocess.run(
        [sys.executable, "-m", "hermes_env_core.cli", "shell", "--session", "sh"], input="cd /usr\nexport Z=9\n",
        capture_output=True, text=True, env={**os.environ, "XDG_STATE_HOME": str(state_home)}, timeout=120,
    )
    assert sh.returncode == 0, sh.stderr
    r = cli(state_home, "run", "--session", "sh", "echo $Z $PWD")
    assert r.stdout == "9 /usr\n", r.stderr
    cli(state_home, "sessions", "rm", "sh")


def test_the_saved_checkpoint_reads_back_equal(state_home):
    env = create_environment("local", session="ck")
    env.execute("cd /etc; declare -A m=([k]='a b'); set -o noglob; alias ll='ls -l'; trap 'echo t' USR1; g() { :; }")
    env.detach()
    baseline, state, saved, size = SessionStore().get_state("ck")
    assert state is not None and baseline is not None and saved and size
    from hermes_env_core.environment.named_store import state_from_json, state_to_json
    assert state_from_json(state_to_json(state)) == state
    assert state.cwd == "/etc" and "noglob" in state.shellopts and "m" in state.variables
    create_environment(session="ck").close()


@given(st.text(min_size=1, max_size=70))
@settings(max_examples=200, deadline=None)
def test_session_names_are_checked_before_they_reach_a_path(name):
    from hermes_env_core.environment.named_store import check_name
    from hermes_env_core.errors import UsageError

    ok = bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name))
    if ok:
        assert check_name(name) == name
    else:
        with pytest.raises(UsageError, match="invalid session name"):
            check_name(name)


@given(st.dictionaries(st.sampled_from(["host", "port", "password", "api_token", "env", "image", "secret_key"]),
                       st.one_of(st.text(max_size=20), st.integers(), st.booleans())))
@settings(max_examples=100, deadline=None)
def test_a_record_keeps_no_option_that_looks_secret(options):
    from hermes_env_core.environment.named_store import public_options

    kept = public_options(options)
    assert set(kept) == set(options) - {"password", "api_token", "env", "secret_key"}
    assert all(kept[k] == options[k] for k in kept)
