"""Background processes in minimal docker images (built here with ``docker import``): a missing tool is
named with the image, a failed start leaves no container or volume behind, and ``doctor`` checks it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_env_core.backends._docker_reaper import container_name
from hermes_env_core.errors import UnsupportedOperation
from hermes_env_core.processes import ProcessRegistry
from tests.processes.minimal_image import minimal_image
from tests.support.docker_engine import ensure_engine

pytestmark = pytest.mark.docker

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")
# What a shell session itself needs; no mkfifo, no setsid, no script.
_BASE_TOOLS = ("mkdir", "cat", "rm", "tail", "head", "wc")


@pytest.fixture(scope="module")
def client():
    return ensure_engine()


@pytest.fixture(scope="module")
def bare_image(client) -> str:
    return minimal_image(client, _BASE_TOOLS)


@pytest.fixture(scope="module")
def no_setsid_image(client) -> str:
    return minimal_image(client, _BASE_TOOLS + ("mkfifo",))


@pytest.fixture
def cli(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    env["HERMES_ENV_PROCESSES_FILE"] = str(tmp_path / "state" / "processes.json")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([HERMES_ENV, *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=120, stdin=subprocess.DEVNULL)

    return run


def _made_by(client, name: str, since: float) -> tuple[list[str], list[str]]:
    """Ids of the containers named ``name`` created since ``since``, and the volumes mounted into them."""
    until = time.time() + 1
    created = [e["Actor"]["ID"] for e in client.events(since=int(since), until=int(until), decode=True,
                                                      filters={"type": "container", "event": "create"})
               if e["Actor"]["Attributes"].get("name") == name]
    volumes = [e["Actor"]["ID"] for e in client.events(since=int(since), until=int(until), decode=True,
                                                     filters={"type": "volume", "event": "mount"})
               if e["Actor"]["Attributes"].get("container") in created]
    return created, volumes


def _exists(client, kind: str, ident: str) -> bool:
    import docker

    try:
        (client.containers if kind == "container" else client.volumes).get(ident)
        return True
    except docker.errors.NotFound:
        return False


def test_a_missing_tool_is_named_with_the_image_and_nothing_is_left(cli, client, bare_image: str) -> None:
    task_id = "bg-min-" + secrets.token_hex(4)
    since = time.time() - 1
    r = cli("run", "--background", "--env", "docker", "-o", f"image={bare_image}", "-o", f"task_id={task_id}",
            "sleep 30")
    assert r.returncode == 125 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert "mkfifo" in line and f"image {bare_image!r}" in line and "cannot create" not in line, line
    name = container_name(task_id, persistent=True)
    containers, volumes = _made_by(client, name, since)
    assert len(containers) == 1 and volumes  # it did make a container with its volume ...
    assert not _exists(client, "container", containers[0])  # ... and removed both
    assert not any(_exists(client, "volume", v) for v in volumes)
    assert json.loads(cli("ps", "--all", "--json").stdout) == []


def test_the_library_says_the_same(client, bare_image: str, tmp_path: Path) -> None:
    from hermes_env_core.backends.docker import DockerEnvironment

    with DockerEnvironment(image=bare_image) as env, ProcessRegistry(checkpoint=tmp_path / "p.json") as reg:
        with pytest.raises(UnsupportedOperation, match="no mkfifo") as err:
            reg.spawn(env, "sleep 30")
        assert "mkfifo" in str(err.value) and bare_image in str(err.value)
        assert reg.list() == []


def test_doctor_checks_what_background_processes_need(cli, bare_image: str, no_setsid_image: str) -> None:
    r = cli("doctor", "--env", "docker", "-o", f"image={bare_image}", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    (entry,) = json.loads(r.stdout)["backends"]
    (problem,) = entry["problems"]
    assert "run --background" in problem and "no mkfifo" in problem and bare_image in problem
    r = cli("doctor", "--env", "docker", "-o", f"image={no_setsid_image}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"note: image {no_setsid_image!r} has no setsid" in r.stdout
    assert "has no script: needed for --pty" in r.stdout


def test_without_setsid_a_background_process_still_runs(cli, client, no_setsid_image: str) -> None:
    r = cli("run", "--background", "--env", "docker", "-o", f"image={no_setsid_image}", "echo up; sleep 1; echo down")
    assert r.returncode == 0, r.stderr
    pid_id = r.stdout.split()[0]
    w = cli("wait", pid_id)
    assert (w.returncode, w.stdout) == (0, f"[{pid_id}] exited (exit code 0)\n"), w.stderr
    assert cli("logs", pid_id).stdout == "up\ndown\n"
