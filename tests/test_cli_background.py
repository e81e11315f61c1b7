"""Background commands through the console script: a docker process keeps its container until it ends,
``ps`` says ``unknown`` (with why) for what it cannot check, and --watch matches show in ps, logs and wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_env_core.testing import wait_until
from tests.support.docker_engine import ensure_engine, ensure_test_image

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")


@pytest.fixture
def cli(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    env["HERMES_ENV_PROCESSES_FILE"] = str(tmp_path / "state" / "processes.json")

    def run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [HERMES_ENV, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    run.state = tmp_path / "state"  # type: ignore[attr-defined]
    return run


def _rows(cli) -> dict[str, dict]:
    proc = cli("ps", "--all", "--json")
    assert proc.returncode == 0, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)}


# -- local ------------------------------------------------------------------------------------


def test_wait_returns_at_a_watch_match_already_printed_and_ps_and_logs_show_it(cli):
    r = cli("run", "--background", "--watch", "ready", "echo booting; echo ready on 8080; sleep 300")
    assert r.returncode == 0, r.stderr
    pid_id = r.stdout.split()[0]
    try:
        assert wait_until(lambda: "ready on 8080" in cli("logs", pid_id).stdout, 20)
        started = time.monotonic()
        w = cli("wait", pid_id)
        assert (w.returncode, w.stdout) == (0, f"[{pid_id}] matched 'ready': ready on 8080\n"), w.stderr
        assert time.monotonic() - started < 20
        row = _rows(cli)[pid_id]
        assert row["status"] == "running" and row["watch"] == ["ready"] and row["match_count"] == 1
        assert row["matches"] == [{"pattern": "ready", "line": "ready on 8080"}]
        assert "1x 'ready on 8080'" in cli("ps").stdout
        logs = cli("logs", pid_id)
        assert logs.stdout == "booting\nready on 8080\n"
        assert f"1 line(s) matched --watch ready (hermes-env logs --matches {pid_id})" in logs.stderr
        assert cli("logs", "--matches", pid_id).stdout == "ready: ready on 8080\n"
    finally:
        cli("kill", pid_id)


def test_wait_blocks_until_a_later_match(cli, tmp_path):
    go = tmp_path / "go"
    os.mkfifo(go)
    r = cli("run", "--background", "--watch-regex", "^listening [0-9]+$", f"echo warming; read _ <{go}; echo listening 99; sleep 300")
    pid_id = r.stdout.split()[0]
    waiter = subprocess.Popen(
        [HERMES_ENV, "wait", pid_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HERMES_ENV_PROCESSES_FILE": str(cli.state / "processes.json")},
    )
    try:
        assert wait_until(lambda: "warming" in cli("logs", pid_id).stdout, 20)
        assert waiter.poll() is None  # nothing matched yet: still waiting
        with open(go, "w") as f:
            f.write("\n")
        out, err = waiter.communicate(timeout=60)
        assert (waiter.returncode, out) == (0, f"[{pid_id}] matched '/^listening [0-9]+$/': listening 99\n"), err
    finally:
        waiter.kill()
        cli("kill", pid_id)


def test_wait_passes_the_exit_status_through_and_times_out_with_124(cli):
    r = cli("run", "--background", "echo done; exit 7")
    pid_id = r.stdout.split()[0]
    w = cli("wait", pid_id)
    assert (w.returncode, w.stdout) == (7, f"[{pid_id}] exited (exit code 7)\n"), w.stderr
    r = cli("run", "--background", "sleep 300")
    slow = r.stdout.split()[0]
    try:
        w = cli("wait", "--timeout", "1", slow)
        assert w.returncode == 124 and "still running after 1s" in w.stderr
    finally:
        cli("kill", slow)


# -- docker ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> str:
    return ensure_test_image(ensure_engine())


def _container(task_id: str):
    client = ensure_engine()
    found = client.containers.list(all=True, filters={"label": f"hermes-env.task-id={task_id}"})
    return found[0] if found else None


@pytest.mark.docker
def test_a_docker_background_process_keeps_its_container_until_killed(cli, image):
    r = cli("run", "--background", "--env", "docker", "-o", f"image={image}", "--watch", "tick 2",
            "for i in 1 2 3; do echo tick $i; done; sleep 300")
    assert r.returncode == 0, r.stderr
    pid_id = r.stdout.split()[0]
    row = _rows(cli)[pid_id]
    task_id = row["where"].removeprefix("docker:")
    assert row["status"] == "running" and task_id.startswith("bg-"), row
    container = _container(task_id)
    assert container is not None and container.status == "running"  # `run` returned; the container stayed
    assert wait_until(lambda: cli("logs", pid_id).stdout == "tick 1\ntick 2\ntick 3\n", 30)
    w = cli("wait", pid_id)
    assert (w.returncode, w.stdout) == (0, f"[{pid_id}] matched 'tick 2': tick 2\n"), w.stderr
    assert _rows(cli)[pid_id]["match_count"] == 1
    k = cli("kill", pid_id)
    assert k.returncode == 0 and "killed" in k.stdout, k.stderr
    assert _container(task_id) is None  # removed once nothing runs there
    row = _rows(cli)[pid_id]
    assert (row["status"], row["exit_code"]) == ("killed", 143)
    assert cli("logs", pid_id).stdout == "tick 1\ntick 2\ntick 3\n"  # kept here before the container went


@pytest.mark.docker
def test_a_docker_background_process_that_exits_is_reported_and_its_container_removed(cli, image):
    r = cli("run", "--background", "--env", "docker", "-o", f"image={image}", "-o", 'env={"TOKEN_X": "s3cret"}',
            "-o", "timeout=30", "echo out; exit 3")
    kept = (cli.state / "processes.envs.json").read_text()
    assert "s3cret" not in kept and "TOKEN_X" not in kept and '"timeout": 30' in kept
    pid_id = r.stdout.split()[0]
    task_id = _rows(cli)[pid_id]["where"].removeprefix("docker:")
    w = cli("wait", pid_id)
    assert (w.returncode, w.stdout) == (3, f"[{pid_id}] exited (exit code 3)\n"), w.stderr
    assert wait_until(lambda: _rows(cli)[pid_id]["status"] == "exited", 20)
    assert _container(task_id) is None
    assert cli("logs", pid_id).stdout == "out\n"


@pytest.mark.docker
def test_ps_says_unknown_with_the_reason_when_it_cannot_check(cli, image, tmp_path):
    r = cli("run", "--background", "--env", "docker", "-o", f"image={image}", "sleep 300")
    pid_id = r.stdout.split()[0]
    envs_file = cli.state / "processes.envs.json"
    saved = envs_file.read_text()
    task_id = _rows(cli)[pid_id]["where"].removeprefix("docker:")
    try:
        data = json.loads(saved)
        [entry] = data.values()
        entry["options"]["docker_host"] = f"unix://{tmp_path}/no-engine.sock"  # the engine is unreachable
        envs_file.write_text(json.dumps(data))
        row = _rows(cli)[pid_id]
        assert row["status"] == "unknown" and "cannot open" in row["note"] and "no-engine.sock" in row["note"]
        assert f"{pid_id}: not checked: cannot open docker:{task_id}" in cli("ps").stdout
        k = cli("kill", pid_id)
        assert k.returncode == 125 and "cannot kill" in k.stderr
    finally:
        envs_file.write_text(saved)
        cli("kill", pid_id)
    assert _container(task_id) is None


@pytest.mark.docker
def test_a_container_removed_behind_our_back_makes_the_process_lost(cli, image):
    r = cli("run", "--background", "--env", "docker", "-o", f"image={image}", "sleep 300")
    pid_id = r.stdout.split()[0]
    task_id = _rows(cli)[pid_id]["where"].removeprefix("docker:")
    _container(task_id).remove(force=True)
    row = _rows(cli)[pid_id]
    assert row["status"] == "lost" and row["note"] == f"its environment docker:{task_id} is gone"
    assert _container(task_id) is None  # ps did not create one to look
    assert _rows(cli)[pid_id]["status"] == "lost"  # and says so again


@pytest.mark.docker
def test_an_environment_given_on_the_command_line_is_used_to_check(cli, image, tmp_path):
    r = cli("run", "--background", "--env", "docker", "-o", f"image={image}", "-o", "task_id=bg-given-1", "sleep 300")
    pid_id = r.stdout.split()[0]
    envs_file = cli.state / "processes.envs.json"
    try:
        envs_file.write_text("{}")  # as for a process started from Python: nothing recorded to reopen it
        row = _rows(cli)[pid_id]
        assert row["status"] == "unknown" and "how to open that environment was not recorded" in row["note"]
        args = ("--env", "docker", "-o", f"image={image}", "-o", "task_id=bg-given-1", "-o", "persistent=true")
        rows = {r["id"]: r for r in json.loads(cli("ps", "--json", *args).stdout)}
        assert rows[pid_id]["status"] == "running"
        k = cli("kill", *args, pid_id)
        assert k.returncode == 0 and "killed" in k.stdout, k.stderr
    finally:
        c = _container("bg-given-1")
        if c is not None:
            c.remove(force=True)
