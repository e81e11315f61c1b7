"""Instance lifecycle: stop on cleanup, finalizer, orphan sweep, a vanished instance, persistent overlays."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hermes_env_singularity.backend import SingularityEnvironment
from hermes_env_singularity.instances import (
    INSTANCE_PREFIX,
    instance_name,
    list_instances,
    owner_of,
    process_start,
    stop_instance,
    sweep_orphans,
)
from hermes_env_singularity.runtime import Runtime, client_env
from singularity_support import PLUGIN_ROOT

from hermes_env_core.errors import BackendError, EnvironmentUnavailable


def _names(runtime: Runtime) -> set[str]:
    return {str(i["instance"]) for i in list_instances(runtime)}


def _start_raw(runtime: Runtime, sif: Path, name: str) -> None:
    proc = runtime.run(["instance", "start", "--containall", "--no-home", str(sif), name], env=client_env())
    assert proc.returncode == 0, proc.stderr


def test_name_records_the_owner() -> None:
    name = instance_name("task/with spaces")
    assert name.startswith(INSTANCE_PREFIX)
    assert owner_of(name) == (os.getpid(), process_start(os.getpid()))
    assert "task_with_spaces" in name
    assert owner_of("someone-elses") is None


def test_cleanup_stops_the_instance(runtime: Runtime, sif: Path) -> None:
    env = SingularityEnvironment(image=str(sif))
    name = env.instance_name
    assert name in _names(runtime)
    env.close()
    assert env.instance_name is None
    assert name not in _names(runtime)


def test_dropped_environment_is_stopped(runtime: Runtime, sif: Path) -> None:
    env = SingularityEnvironment(image=str(sif))
    name = env.instance_name
    del env
    gc.collect()
    assert name not in _names(runtime)


CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from hermes_env_singularity.backend import SingularityEnvironment
env = SingularityEnvironment(image=sys.argv[2])
print(env.instance_name, flush=True)
os._exit(0)  # dies without cleanup or finalizers, as a killed process would
"""


def test_orphan_sweep_stops_only_ours_whose_owner_is_dead(runtime: Runtime, sif: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(PLUGIN_ROOT), str(sif)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    orphan = child.stdout.strip()
    assert orphan.startswith(INSTANCE_PREFIX) and orphan in _names(runtime)
    # Our pid but another start time: a reused pid, so its owner is gone too.
    reused = f"{INSTANCE_PREFIX}{os.getpid()}-zzzzzz-x-000000"
    foreign = f"not-hermes-{os.getpid()}-zzzzzz"
    _start_raw(runtime, sif, reused)
    _start_raw(runtime, sif, foreign)
    try:
        with SingularityEnvironment(image=str(sif)) as live:
            stopped = sweep_orphans(runtime)
            assert orphan in stopped and reused in stopped
            names = _names(runtime)
            assert orphan not in names and reused not in names
            assert live.instance_name in names and foreign in names
            assert live.execute("echo alive").output == "alive\n"
    finally:
        stop_instance(runtime, foreign)
        stop_instance(runtime, reused)


@pytest.mark.parametrize("channel", [False, True])
def test_vanished_instance_raises_then_recovers(runtime: Runtime, sif: Path, channel: bool) -> None:
    with SingularityEnvironment(image=str(sif), channel=channel) as env:
        env.execute("export HERMES_T_KEPT=yes; cd /tmp")
        old = env.instance_name
        assert stop_instance(runtime, old)
        if not channel:
            with pytest.raises(BackendError, match="no instance found.*next command starts a new one"):
                env.execute("echo lost")
        # (An idle channel dies with the instance: the next command already gets a new one.)
        r = env.execute('echo "$HERMES_T_KEPT $PWD"')
        assert r.output == "yes /tmp\n"
        assert any("was gone" in n for n in r.notes), r.notes
        assert env.instance_name != old and env.instance_name in _names(runtime)


def test_image_without_bash_is_a_clear_error(runtime: Runtime, tmp_path: Path) -> None:
    from singularity_support import build_rootfs

    root = build_rootfs(tmp_path / "nobash", commands=("cat", "true"))
    # apptainer needs a /bin/sh to build; make it `true`, so that no bash is left.
    (root / "usr/bin/sh").unlink()
    (root / "usr/bin/sh").symlink_to("true")
    out = tmp_path / "nobash.sif"
    proc = runtime.run(["build", str(out), str(root)], env=client_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    with SingularityEnvironment(image=str(out)) as env, pytest.raises(EnvironmentUnavailable, match="needs bash"):
        env.execute("echo hi")


def test_persistent_overlay_keeps_files_per_task(sif: Path, tmp_path: Path) -> None:
    opts = dict(image=str(sif), overlay="persistent", overlay_dir=str(tmp_path / "ov"), task_id="task-ovl")
    with SingularityEnvironment(**opts) as env:
        assert env.execute("mkdir -p /work && echo kept > /work/file && echo tmp > /tmp/gone").exit_code == 0
        overlay = env.overlay_path
        assert overlay is not None and overlay.startswith(str(tmp_path / "ov"))
        with pytest.raises(EnvironmentUnavailable, match="in use by another environment"):
            SingularityEnvironment(**opts)
    with SingularityEnvironment(**opts) as env:
        # /tmp is the instance's own (the session's private state directory lives there): the file is gone.
        assert env.execute("cat /work/file; [ -e /tmp/gone ] || echo tmp-cleared").output == "kept\ntmp-cleared\n"
    with SingularityEnvironment(**{**opts, "task_id": "other-task"}) as env:
        assert env.execute("cat /work/file").exit_code != 0


def test_tmpfs_overlay_is_lost_at_cleanup(sif: Path) -> None:
    with SingularityEnvironment(image=str(sif), task_id="t") as env:
        env.execute("echo x > /root/scratch")
    with SingularityEnvironment(image=str(sif), task_id="t") as env:
        assert env.execute("cat /root/scratch").exit_code != 0


def test_read_only_without_overlay(sif: Path) -> None:
    with SingularityEnvironment(image=str(sif), overlay="none") as env:
        r = env.execute("echo x > /root/scratch")
        assert r.exit_code != 0 and "Read-only file system" in r.output
        assert env.execute("echo y > /tmp/ok && cat /tmp/ok").output == "y\n"
