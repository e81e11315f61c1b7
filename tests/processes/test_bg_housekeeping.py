"""``hermes-env ps`` / ``ps --all`` / ``rm`` / ``prune`` and ``--env``, through the console script,
each call a separate process: ended processes leave the default listing, and are forgotten on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_env_core.processes import procinfo
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

    run.checkpoint = tmp_path / "state" / "processes.json"  # type: ignore[attr-defined]
    return run


def _start(cli, command: str, *options: str) -> tuple[str, int]:
    r = cli("run", "--background", *options, command)
    assert r.returncode == 0, r.stderr
    pid_id, _, pid = r.stdout.split()
    return pid_id, int(pid)


def _ps(cli, *args: str) -> dict[str, dict]:
    r = cli("ps", "--json", *args)
    assert r.returncode == 0, r.stderr
    return {row["id"]: row for row in json.loads(r.stdout)}


def _ended(cli, pid_id: str) -> None:
    w = cli("wait", pid_id, "--timeout", "60")
    assert w.returncode != 124, w.stdout + w.stderr


def _record(cli, pid_id: str) -> dict | None:
    data = json.loads(cli.checkpoint.read_text())
    for rec in data["live"] + data["finished"]:
        if rec["id"] == pid_id:
            return rec
    return None


def test_ps_shows_running_ones_and_all_shows_ended_ones(cli, marker: str) -> None:
    done, _ = _start(cli, "echo finished")
    busy, pid = _start(cli, f"sleep 300 # {marker}")
    try:
        _ended(cli, done)
        assert list(_ps(cli)) == [busy]
        rows = _ps(cli, "--all")
        assert {i: r["status"] for i, r in rows.items()} == {done: "exited", busy: "running"}
        text = cli("ps").stdout
        assert busy in text and done not in text
        assert done in cli("ps", "-a").stdout
    finally:
        os.kill(pid, 9)


def test_rm_forgets_an_ended_process_its_output_and_its_files(cli) -> None:
    pid_id, _ = _start(cli, "echo some output")
    _ended(cli, pid_id)
    assert cli("logs", pid_id).stdout == "some output\n"
    rec = _record(cli, pid_id)
    assert rec is not None and os.path.isdir(rec["dir"])
    r = cli("rm", pid_id)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{pid_id}\n", "")
    assert pid_id not in _ps(cli, "--all")
    assert _record(cli, pid_id) is None
    assert not os.path.exists(rec["dir"])  # its directory in the target went too
    r = cli("logs", pid_id)
    assert r.returncode == 2 and f"no background process {pid_id!r}" in r.stderr


def test_rm_refuses_a_running_process_unless_forced(cli, marker: str) -> None:
    pid_id, pid = _start(cli, f"sleep 300 # {marker}")
    try:
        r = cli("rm", pid_id)
        assert r.returncode == 1 and r.stdout == ""
        assert f"{pid_id} is running" in r.stderr and "--force" in r.stderr
        assert procinfo.is_alive(pid) and _ps(cli)[pid_id]["status"] == "running"
        r = cli("rm", "--force", pid_id)
        assert (r.returncode, r.stdout) == (0, f"{pid_id}\n"), r.stderr
        assert wait_until(lambda: not procinfo.is_alive(pid), 10)
        assert pid_id not in _ps(cli, "--all")
    finally:
        if procinfo.is_alive(pid):
            os.kill(pid, 9)


def test_rm_bad_input(cli) -> None:
    pid_id, _ = _start(cli, "true")
    _ended(cli, pid_id)
    r = cli("rm", "bg-nope", pid_id)
    assert r.returncode == 2 and "no background process 'bg-nope'" in r.stderr
    assert pid_id in _ps(cli, "--all")  # nothing was removed: the whole request was refused
    r = cli("rm")
    assert r.returncode == 2 and "ID" in r.stderr
    r = cli("rm", "--env", "dokcer", pid_id)
    assert r.returncode == 2 and "did you mean 'docker'" in r.stderr


def test_a_lost_process_stays_listed_until_removed(cli, marker: str) -> None:
    pid_id, pid = _start(cli, f"sleep 300 # {marker}")
    try:
        data = json.loads(cli.checkpoint.read_text())
        data["live"][0]["start_time"] += 1  # its pid now belongs to another process
        cli.checkpoint.write_text(json.dumps(data))
        assert pid_id not in _ps(cli)
        assert _ps(cli, "--all")[pid_id]["status"] == "lost"
        assert _ps(cli, "--all")[pid_id]["status"] == "lost"  # kept, and said again
        r = cli("prune")
        assert (r.returncode, r.stdout) == (0, f"{pid_id}\n"), r.stderr
        assert _record(cli, pid_id) is None
        assert procinfo.is_alive(pid)  # not ours any more: never signalled
    finally:
        os.kill(pid, 9)


def test_prune_forgets_every_ended_process_and_keeps_running_ones(cli, marker: str) -> None:
    a, _ = _start(cli, "exit 3")
    b, _ = _start(cli, "echo b")
    busy, pid = _start(cli, f"sleep 300 # {marker}")
    try:
        _ended(cli, a)
        _ended(cli, b)
        r = cli("prune")
        assert (r.returncode, sorted(r.stdout.split())) == (0, sorted([a, b])), r.stderr
        assert list(_ps(cli, "--all")) == [busy]
        r = cli("prune")
        assert (r.returncode, r.stdout, r.stderr) == (0, "", "nothing to prune\n")
    finally:
        os.kill(pid, 9)


@pytest.mark.docker
def test_env_selects_the_backend_for_ps_rm_and_prune(cli, marker: str) -> None:
    image = ensure_test_image(ensure_engine())
    local_done, _ = _start(cli, "echo local")
    docker_done, _ = _start(cli, "echo docker", "--env", "docker", "-o", f"image={image}")
    docker_busy, _ = _start(cli, f"sleep 300 # {marker}", "--env", "docker", "-o", f"image={image}")
    try:
        _ended(cli, local_done)
        _ended(cli, docker_done)
        # --env alone needs no options: it selects, and opens nothing it does not need.
        assert set(_ps(cli, "--all", "--env", "docker")) == {docker_done, docker_busy}
        assert set(_ps(cli, "--env", "docker")) == {docker_busy}
        assert set(_ps(cli, "--all", "--env", "local")) == {local_done}
        task_id = _ps(cli, "--env", "docker")[docker_busy]["task_id"]
        assert set(_ps(cli, "--all", "--env", "docker", "-o", f"task_id={task_id}", "-o", f"image={image}",
                       "-o", "persistent=true")) == {docker_busy}
        r = cli("rm", "--env", "docker", local_done)
        assert r.returncode == 2 and "runs in local" in r.stderr
        r = cli("prune", "--env", "local")
        assert (r.returncode, r.stdout) == (0, f"{local_done}\n"), r.stderr
        assert set(_ps(cli, "--all")) == {docker_done, docker_busy}
        r = cli("prune", "--env", "docker")
        assert (r.returncode, r.stdout) == (0, f"{docker_done}\n"), r.stderr
    finally:
        cli("rm", "--force", docker_busy)
    assert _ps(cli, "--all") == {}
