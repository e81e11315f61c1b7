"""Timeouts, cancel, close and a failing output callback leave no process behind,
on local (with and without a cgroup), ssh and docker.

The target's processes are this machine's (ssh to 127.0.0.1, docker on the
local engine), so each test finds its own by a unique ``sleep`` argument and
waits for them to be gone.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import hermes_env_core.backends._local_tree as local_tree
from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.errors import EnvironmentClosedError
from hermes_env_core.testing import wait_until

GONE_WITHIN_S = 15.0  # remote kills run as helper commands; bounded, never a fixed sleep


def _token() -> str:
    # A sleep length no other process on the machine has: "3600.<12 digits>".
    return f"3600.{secrets.randbelow(10**12):012d}"


def _procs(token: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if token in (proc.info["cmdline"] or ()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _assert_gone(token: str, timeout: float = GONE_WITHIN_S) -> None:
    """Every process carrying ``token`` exits within ``timeout``."""
    alive = _procs(token)
    _, still = psutil.wait_procs(alive, timeout=timeout)
    still = [p for p in still if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not still, f"left running: {[(p.pid, p.cmdline()) for p in still]}"
    # A process started between the listing and the wait would have escaped it.
    assert not _procs(token)


# -- environments ---------------------------------------------------------------------------------
def _local(**kw) -> BaseEnvironment:
    return LocalEnvironment(**kw)


@pytest.fixture(params=["local", "local-no-cgroup", "ssh", "docker"])
def make_env(request, tmp_path: Path) -> Iterator:
    made: list[BaseEnvironment] = []
    kind = request.param

    if kind == "local":
        assert local_tree.cgroup_pool() is not None, "this machine can make cgroups; the test expects one"
    if kind == "ssh":
        server = request.getfixturevalue("sshd_server")
    if kind == "docker":
        image = request.getfixturevalue("docker_image")

    def make(**kw) -> BaseEnvironment:
        if kind == "local":
            env = _local(**kw)
        elif kind == "local-no-cgroup":  # as on a machine where no cgroup can be made
            env = _local(cgroup=False, **kw)
        elif kind == "ssh":
            from hermes_env_core.backends.ssh import SSHEnvironment

            env = SSHEnvironment(
                host=server.host, port=server.port, user=server.user, key_path=str(server.client_key_path),
                use_agent=False, look_for_keys=False, known_hosts=str(tmp_path / "known_hosts"), **kw,
            )
        else:
            from hermes_env_core.backends.docker import DockerEnvironment

            env = DockerEnvironment(image=image, pull="never", task_id=f"kill-{uuid.uuid4().hex[:8]}", **kw)
        made.append(env)
        return env

    make.kind = kind  # type: ignore[attr-defined]
    yield make
    for env in made:
        env.close()


# -- the whole tree dies ---------------------------------------------------------------------------
def test_timeout_kills_child_that_ignores_term_after_bash_exited(make_env):
    token = _token()
    env = make_env(kill_grace_s=0.5)
    r = env.execute(f"bash -c 'trap \"\" TERM; echo started; sleep {token}' & wait", timeout=1)
    assert r.timed_out and r.exit_code == 124
    assert "started" in r.output
    _assert_gone(token)


def test_timeout_kills_setsid_descendant(make_env):
    token = _token()
    env = make_env(kill_grace_s=0.5)
    r = env.execute(f"setsid bash -c 'echo started; sleep {token}' & wait", timeout=1)
    assert r.timed_out and "started" in r.output
    _assert_gone(token)


def test_timeout_kills_setsid_descendant_ignoring_term(make_env):
    token = _token()
    env = make_env(kill_grace_s=0.5)
    r = env.execute(
        f"setsid bash -c 'trap \"\" TERM; echo started; sleep {token}' </dev/null & sleep 100", timeout=1
    )
    assert r.timed_out and "started" in r.output
    _assert_gone(token)


def test_cancel_kills_the_tree(make_env):
    token = _token()
    env = make_env(kill_grace_s=0.5)
    cancel = threading.Event()

    def seen(text: str) -> None:
        if "started" in text:
            cancel.set()

    r = env.execute(
        f"bash -c 'trap \"\" TERM; echo started; sleep {token}' & wait", cancel=cancel, on_output=seen, timeout=60
    )
    assert r.interrupted and r.exit_code == 130
    _assert_gone(token)


def test_detached_orphan_of_a_timed_out_command_dies_with_cgroup():
    # Local only: only a cgroup sees a process re-parented before the first signal.
    assert local_tree.cgroup_pool() is not None, "this machine can make cgroups; the test expects one"
    token = _token()
    env = _local(kill_grace_s=0.5)
    # The subshell exits at once: the sleep is re-parented to init before any signal.
    try:
        r = env.execute(f"(setsid sleep {token} </dev/null >/dev/null 2>&1 &); echo started; sleep 100", timeout=1)
        assert r.timed_out and "started" in r.output
        _assert_gone(token, timeout=5.0)
    finally:
        env.close()


def test_background_job_of_a_finished_command_keeps_running(make_env):
    token = _token()
    env = make_env()
    r = env.execute(f"nohup sleep {token} </dev/null >/dev/null 2>&1 &")
    assert r.exit_code == 0
    # The job may not have exec'd its sleep yet when the command returns.
    assert wait_until(lambda: len(_procs(token)) == 1, timeout=10)
    procs = _procs(token)
    # A later timeout does not take it along.
    assert env.execute("sleep 100", timeout=0.5).timed_out
    assert procs[0].is_running() and procs[0].status() != psutil.STATUS_ZOMBIE
    procs[0].kill()
    _assert_gone(token)


# -- close() and a raising on_output ---------------------------------------------------------------
def test_close_stops_a_running_command_and_returns_once_gone(make_env):
    token = _token()
    env = make_env(kill_grace_s=0.5, timeout=120)
    started = threading.Event()
    results: list[object] = []

    def run() -> None:
        try:
            results.append(env.execute(
                f"bash -c 'trap \"\" TERM; echo started; sleep {token}' & wait",
                on_output=lambda t: started.set() if "started" in t else None,
            ))
        except BaseException as exc:  # noqa: BLE001 - checked below
            results.append(exc)

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    env.close()
    # close() returned: the execute() call has returned too, and the command is gone.
    t.join(timeout=0.1)
    assert not t.is_alive()
    (r,) = results
    assert getattr(r, "interrupted", False), r
    assert any("closed" in n for n in r.notes)
    if make_env.kind.startswith("local"):
        assert not _procs(token)  # local: gone before close() returned
    _assert_gone(token)
    with pytest.raises(EnvironmentClosedError):
        env.execute("true")


class _Stop(Exception):
    pass


def test_raising_output_callback_stops_the_command(make_env):
    token = _token()
    env = make_env(kill_grace_s=0.5)

    def boom(text: str) -> None:
        if "started" in text:
            raise _Stop(text)

    with pytest.raises(_Stop):
        env.execute(f"echo started; sleep {token}", on_output=boom, timeout=60)
    if make_env.kind.startswith("local"):
        assert not _procs(token)  # stopped before the exception reached us
    _assert_gone(token)
    assert env.execute("echo still usable").output == "still usable\n"


# -- timeout validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, 0.0, -5, -0.1, math.nan, "1", True])
def test_timeout_must_be_positive(bad):
    with LocalEnvironment() as env:
        with pytest.raises(ValueError, match="timeout") as info:
            env.execute("echo never", timeout=bad)
        assert repr(bad) in str(info.value)
        assert env.execute("echo ok").output == "ok\n"


def test_timeout_none_means_configured_default():
    with LocalEnvironment(timeout=0.5, kill_grace_s=0.2) as env:
        r = env.execute("sleep 100", timeout=None)
    assert r.timed_out and any("0.5s" in n for n in r.notes)


def test_local_command_runs_in_its_own_cgroup_unless_turned_off():
    own, pool = local_tree.cgroup_pool()  # this machine can make them (root, cgroup v2)
    rel = pool[len(own):] if own != "/" else pool
    with LocalEnvironment() as env, LocalEnvironment(cgroup=False) as plain, LocalEnvironment() as other:
        first = env.execute("cat /proc/self/cgroup").output
        second = env.execute("cat /proc/self/cgroup").output
        third = other.execute("cat /proc/self/cgroup").output
        off = plain.execute("cat /proc/self/cgroup").output
    line = lambda text: next(x for x in text.splitlines() if x.startswith("0::"))  # noqa: E731
    assert rel.split("/")[-1] in line(first) and rel.split("/")[-1] in line(second)
    # One per session (its server and all it starts), not shared with another session.
    assert line(first) == line(second) and line(first) != line(third)
    assert rel.split("/")[-1] not in line(off)
    # Finished commands leave no cgroup behind (other tests' may still be there).
    for text in (first, second):
        name = line(text).rsplit("/", 1)[-1]
        assert not os.path.exists(os.path.join(pool, name)), name


def test_cgroups_left_by_a_dead_process_are_removed_and_live_ones_kept():
    own, pool = local_tree.cgroup_pool()
    dead_pid = 4_000_000  # above pid_max: no process has it
    dead = os.path.join(own, f"hermes-env-{dead_pid}-{os.urandom(4).hex()}")
    os.makedirs(os.path.join(dead, "c7"))
    local_tree._sweep_dead_pools(own)
    assert not os.path.exists(dead)
    assert os.path.isdir(pool)  # ours: this process is alive
