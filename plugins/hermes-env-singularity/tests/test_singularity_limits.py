"""--cpus/--memory: applied where the host supports them, a note (or an error) where not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hermes_env_singularity import backend
from hermes_env_singularity.backend import SingularityEnvironment
from hermes_env_singularity.runtime import Runtime, client_env

from hermes_env_core.errors import EnvironmentUnavailable

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="apptainer applies cgroup limits here only as root")


def _cgroup_dir(runtime: Runtime, name: str, controller: str) -> Path:
    proc = runtime.run(["instance", "list", "--json"], env=client_env())
    pid = next(i["pid"] for i in json.loads(proc.stdout)["instances"] if i["instance"] == name)
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists()):
            base = Path("/sys/fs/cgroup") / (controller if controllers else "")
            return base / path.lstrip("/")
    raise AssertionError(f"no {controller} cgroup for instance {name}")


@needs_root
def test_cpu_and_memory_limits_applied(runtime: Runtime, sif: Path) -> None:
    with SingularityEnvironment(image=str(sif), cpu=0.5, memory="64M") as env:
        assert env.limits_applied
        r = env.execute("true")
        assert not any("limits" in n for n in r.notes)
        mem = _cgroup_dir(runtime, env.instance_name, "memory")
        cpu = _cgroup_dir(runtime, env.instance_name, "cpu")
        if (mem / "memory.max").exists():  # cgroup v2
            assert (mem / "memory.max").read_text().strip() == str(64 * 1024 * 1024)
            assert (cpu / "cpu.max").read_text().split() == ["50000", "100000"]
        else:
            assert (mem / "memory.limit_in_bytes").read_text().strip() == str(64 * 1024 * 1024)
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "50000"
        # Going past the memory limit gets the process OOM-killed (SIGKILL: 137).
        r = env.execute("bash -c 'x=$(head -c 300000000 /dev/zero | tr \"\\\\0\" a)'; echo $?")
        assert r.output.splitlines()[-1] == "137" and "Killed" in r.output, r
        assert env.execute("echo still-here").output == "still-here\n"


def test_without_limits_none_applied(sif: Path) -> None:
    with SingularityEnvironment(image=str(sif)) as env:
        assert not env.limits_applied


def test_out_of_range_cpus_is_an_error_naming_it(sif: Path) -> None:
    with pytest.raises(EnvironmentUnavailable, match="cpus value must be in range"):
        SingularityEnvironment(image=str(sif), cpu=4096)


@pytest.fixture
def no_cgroup_conf(runtime: Runtime, tmp_path: Path) -> str:
    """An apptainer.conf whose cgroup manager cannot work here (systemd, which is not running)."""
    if os.geteuid() != 0:
        pytest.skip("a private apptainer.conf (-c) is honoured for root only in a setuid/root install")
    if Path("/proc/1/comm").read_text().strip() == "systemd":
        pytest.skip("systemd is PID 1 here, so the systemd cgroup manager would work")
    proc = runtime.run(["buildcfg"], env=client_env())
    conf = next(line.split("=", 1)[1] for line in proc.stdout.splitlines() if line.startswith("APPTAINER_CONF_FILE="))
    text = Path(conf).read_text()
    assert "systemd cgroups = " in text
    out = tmp_path / "apptainer.conf"
    out.write_text("\n".join(
        "systemd cgroups = yes" if line.startswith("systemd cgroups =") else line for line in text.splitlines()
    ) + "\n")
    return str(out)


def test_unsupported_limits_are_detected_and_noted(sif: Path, no_cgroup_conf: str, monkeypatch) -> None:
    monkeypatch.setattr(backend, "_limits_unsupported", {})
    with SingularityEnvironment(image=str(sif), apptainer_conf=no_cgroup_conf, cpu=0.5, memory="64M") as env:
        assert not env.limits_applied
        r = env.execute("echo runs")
        assert r.output == "runs\n"
        assert any("resource limits not applied" in n and "cgroup" in n for n in r.notes), r.notes
    assert backend._limits_unsupported, "the failure was not remembered"
    # Later environments skip the doomed attempt but still say so.
    with SingularityEnvironment(image=str(sif), apptainer_conf=no_cgroup_conf, memory="64M") as env:
        assert any("resource limits not applied" in n for n in env.execute("true").notes)


def test_require_limits_raises_when_unsupported(sif: Path, no_cgroup_conf: str, monkeypatch) -> None:
    monkeypatch.setattr(backend, "_limits_unsupported", {})
    with pytest.raises(EnvironmentUnavailable, match="require_limits"):
        SingularityEnvironment(image=str(sif), apptainer_conf=no_cgroup_conf, memory="64M", require_limits=True)
