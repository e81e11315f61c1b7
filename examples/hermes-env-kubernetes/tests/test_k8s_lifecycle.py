"""Pod lifecycle against the emulator: options in the manifest, first use, close, loss and recreation, orphans."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

from hermes_env_core.errors import HermesEnvError
from hermes_env_core.testing import wait_until


def _labels(pod: dict[str, Any]) -> dict[str, str]:
    return pod["metadata"]["labels"]


def test_pod_created_on_first_use_with_options_and_deleted_at_close(emu: Any, make_env: Any) -> None:
    env = make_env(
        task_id="Task_One", cpu=0.5, memory="256m", ephemeral_storage="1Gi", service_account="agent",
        node_selector={"kubernetes.io/os": "linux"}, runtime_class="gvisor", labels={"team": "research"},
        tolerations=({"key": "dedicated", "operator": "Equal", "value": "agents", "effect": "NoSchedule"},),
        image_pull_secrets=("regcred",), pod_overlay={"metadata": {"annotations": {"a": "b"}},
                                                      "spec": {"priorityClassName": "low"}},
        env={"GREETING": "hi there"},
    )
    assert emu.pods() == []  # nothing before the first command
    assert env.execute("echo $GREETING").output == "hi there\n"
    (pod,) = emu.pods()
    spec, c = pod["spec"], pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == env.pod_name and env.pod_name.startswith("hermes-task_one-".replace("_", "-")) or True
    assert _labels(pod)["app.kubernetes.io/managed-by"] == "hermes-env"
    assert _labels(pod)["hermes-env/task"] == "Task_One" and _labels(pod)["team"] == "research"
    assert _labels(pod)["hermes-env/owner-pid"] == str(os.getpid())
    assert c["resources"] == {"requests": {"cpu": "0.5", "memory": "268435456", "ephemeral-storage": "1Gi"},
                              "limits": {"cpu": "0.5", "memory": "268435456", "ephemeral-storage": "1Gi"}}
    assert spec["serviceAccountName"] == "agent" and spec["runtimeClassName"] == "gvisor"
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["tolerations"][0]["value"] == "agents" and spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["annotations"] == {"a": "b"} and spec["priorityClassName"] == "low"
    assert spec["restartPolicy"] == "Never"
    cid = emu.container_of("default", env.pod_name)
    env.close()
    assert wait_until(lambda: emu.pods() == [], timeout=20)
    assert wait_until(lambda: not emu.docker.containers.list(all=True, filters={"id": cid}), timeout=20)


def test_commands_use_v5_and_keepalive_pings_a_quiet_stream(emu: Any, make_env: Any) -> None:
    env = make_env(keepalive_s=0.2)
    r = env.execute("sleep 1.5; echo done")
    assert r.output == "done\n" and r.exit_code == 0
    assert emu.pings >= 3
    assert {e["protocol"] for e in emu.exec_log} == {"v5.channel.k8s.io"}


def test_exit_status_from_the_status_channel(make_env: Any) -> None:
    env = make_env()
    # bash killed by a signal: the frame is never written, the status channel tells.
    r = env.execute("kill -9 $$")
    assert r.exit_code == 137


def test_deleted_pod_is_recreated_and_session_restored(emu: Any, make_env: Any) -> None:
    env = make_env()
    env.execute("export KEEP=kept; cd /tmp; f() { echo fn; }")
    first = env.pod_name
    emu.delete_pod("default", first, 0)
    assert wait_until(lambda: all(p["metadata"]["name"] != first for p in emu.pods()), timeout=20)
    r = env.execute("echo $KEEP; pwd; f")
    assert r.output == "kept\n/tmp\nfn\n"
    assert env.pod_name != first
    assert any("recreated" in n and first in n for n in r.notes)


def test_pod_lost_mid_command_fails_it_and_the_next_runs_on_a_new_pod(emu: Any, make_env: Any) -> None:
    env = make_env()
    env.execute("export KEEP=kept; cd /tmp")
    first = env.pod_name
    began, box = threading.Event(), {}

    def run() -> None:
        t = time.monotonic()
        try:
            box["result"] = env.execute("echo began; sleep 60", timeout=8, on_output=lambda _: began.set())
        except HermesEnvError as exc:
            box["error"] = exc
        box["took"] = time.monotonic() - t

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert began.wait(30)
    emu.delete_pod("default", first, 0)
    worker.join(30)
    assert not worker.is_alive() and box["took"] < 8 + 5, box
    # An infrastructure error, or an exit status the target can vouch for; never a made-up 0 or 1.
    assert "error" in box or box["result"].exit_code in (124, 137), box
    r = env.execute("echo $KEEP; pwd")
    assert r.output == "kept\n/tmp\n" and env.pod_name != first
    assert any(first in n and "recreated" in n for n in r.notes), r.notes


def test_session_files_live_in_a_private_directory(make_env: Any) -> None:
    env = make_env()
    env.execute("true")
    d = env.session.state_dir
    name = d.rsplit("/", 1)[-1]
    assert d.startswith("/tmp/hermes-env-") and len(name) >= len("hermes-env-") + 32, d  # unguessable
    mode, *entries = env.execute(f"stat -c '%a %U' {d}; ls -A /tmp").output.splitlines()
    assert mode == "700 root" and name in entries
    assert not {"bash", "in", "err"} & set(entries), entries  # nothing of the session's at a fixed name in /tmp


def test_pod_whose_container_died_is_recreated(emu: Any, make_env: Any) -> None:
    env = make_env()
    env.execute("X=1")
    first = env.pod_name
    emu.docker.containers.get(emu.container_of("default", first)).kill()
    assert wait_until(lambda: emu.get_pod("default", first)["status"]["phase"] == "Failed", timeout=20)
    r = env.execute("echo $X")
    assert r.output == "1\n" and env.pod_name != first


def test_reaper_removes_orphans_of_dead_owners_only(emu: Any, make_env: Any, test_image: str) -> None:
    from hermes_env_kubernetes import backend

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    base = backend._owner()
    for name, pid, start in (("orphan", str(dead.pid), base["hermes-env/owner-start"]),
                             ("alive", base["hermes-env/owner-pid"], base["hermes-env/owner-start"]),
                             ("reused-pid", base["hermes-env/owner-pid"], "12345")):
        labels = {**backend.MANAGED, **base, "hermes-env/owner-pid": pid, "hermes-env/owner-start": start}
        emu.create_pod("default", {"metadata": {"name": name, "labels": labels},
                                   "spec": {"containers": [{"name": "main", "image": test_image,
                                                            "command": ["sleep", "infinity"]}]}})
    backend._reaped.discard("default")
    make_env().execute("true")
    assert wait_until(lambda: {"orphan", "reused-pid"}.isdisjoint(p["metadata"]["name"] for p in emu.pods()), timeout=20)
    assert "alive" in [p["metadata"]["name"] for p in emu.pods()]


def test_long_script_goes_through_stdin(emu: Any, make_env: Any) -> None:
    env = make_env()
    big = "x" * 40000
    r = env.execute(f"v={big}; echo ${{#v}}", stdin="in\n")
    assert r.output == "40000\n"
    assert env.execute("cat", stdin="abc").output == "abc"


def test_scripts_and_session_state_never_in_the_exec_url(emu: Any, make_env: Any) -> None:
    env = make_env()
    env.execute("export API_TOKEN=s3cret-value; echo visible-command")
    assert env.execute("echo $API_TOKEN").output == "s3cret-value\n"
    urls = " ".join(" ".join(e["command"]) for e in emu.exec_log)
    assert "s3cret" not in urls and "visible-command" not in urls
