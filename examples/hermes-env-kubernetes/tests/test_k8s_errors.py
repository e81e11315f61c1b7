"""Clear errors: RBAC naming the verbs, image pull failures from events, unschedulable pods, start timeouts."""

from __future__ import annotations

from typing import Any

import pytest

from hermes_env_core.errors import EnvironmentUnavailable
from hermes_env_core.testing import wait_until


def test_rbac_denied_pod_create_names_the_verbs(emu: Any, make_env: Any) -> None:
    emu.deny("create", "pods")
    env = make_env()
    with pytest.raises(EnvironmentUnavailable) as info:
        env.execute("true")
    msg = str(info.value)
    assert 'cannot create resource "pods"' in msg and "namespace 'default'" in msg
    assert "pods: create, get, list, delete" in msg and "pods/exec: get, create" in msg


def test_rbac_denied_exec_names_the_verbs(emu: Any, make_env: Any) -> None:
    emu.deny("create", "pods/exec")
    env = make_env()
    with pytest.raises(EnvironmentUnavailable) as info:
        env.execute("true")
    msg = str(info.value)
    assert 'cannot create resource "pods/exec"' in msg and "pods/exec: get, create" in msg
    assert [p["metadata"]["name"] for p in emu.pods()] == [env.pod_name]  # a refused exec does not recreate the pod


def test_image_pull_failure_from_events(emu: Any, make_env: Any) -> None:
    env = make_env(image="registry.invalid/nope:1")
    with pytest.raises(EnvironmentUnavailable) as info:
        env.execute("true")
    msg = str(info.value)
    assert 'Failed to pull image "registry.invalid/nope:1"' in msg and "cannot start" in msg
    assert wait_until(lambda: emu.pods() == [], timeout=20)  # nothing left behind
    # One pod tried: a pod that cannot start is not a lost one to recreate.
    assert len({e["involvedObject"]["name"] for e in emu.store.list("events", "default")}) == 1


def test_unschedulable_pod(emu: Any, make_env: Any) -> None:
    env = make_env(node_selector={"disktype": "ssd"})
    with pytest.raises(EnvironmentUnavailable) as info:
        env.execute("true")
    assert "didn't match Pod's node affinity/selector" in str(info.value)
    assert wait_until(lambda: emu.pods() == [], timeout=20)


def test_untolerated_taint_and_too_much_cpu(emu: Any, make_env: Any) -> None:
    emu.node_taints = [{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]
    with pytest.raises(EnvironmentUnavailable, match="untolerated taint"):
        make_env().execute("true")
    emu.node_taints = []
    with pytest.raises(EnvironmentUnavailable, match="Insufficient cpu"):
        make_env(cpu=1000).execute("true")


def test_tolerated_taint_schedules(emu: Any, make_env: Any) -> None:
    emu.node_taints = [{"key": "dedicated", "value": "agents", "effect": "NoSchedule"}]
    env = make_env(tolerations=({"key": "dedicated", "operator": "Exists"},))
    assert env.execute("echo ok").output == "ok\n"


def test_start_timeout(emu: Any, make_env: Any) -> None:
    emu.start_delay = 3.0
    env = make_env(start_timeout=0.5)
    with pytest.raises(EnvironmentUnavailable, match=r"not Running after 0.5s \(phase Pending\)"):
        env.execute("true")


def test_unknown_runtime_class_is_refused_by_admission(make_env: Any) -> None:
    with pytest.raises(EnvironmentUnavailable, match='RuntimeClass "firecracker" not found'):
        make_env(runtime_class="firecracker").execute("true")


def test_bad_token_is_reported(emu: Any, make_env: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", emu.write_kubeconfig(str(tmp_path / "bad"), token="wrong"))
    with pytest.raises(EnvironmentUnavailable, match="Unauthorized"):
        make_env().execute("true")


def test_missing_kubeconfig_names_the_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from hermes_env_kubernetes.backend import KubernetesEnvironment

    missing = tmp_path / "nope.yaml"
    with pytest.raises(EnvironmentUnavailable, match=str(missing)):
        KubernetesEnvironment(kubeconfig=str(missing))


def test_context_option_picks_namespace(emu: Any, make_env: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes import client, config

    path = emu.write_kubeconfig(str(tmp_path / "kc"), context="other", namespace="agents")
    api = client.CoreV1Api(config.new_client_from_config(config_file=path))
    api.create_namespace({"metadata": {"name": "agents"}})
    env = make_env(kubeconfig=path, context="other")
    assert env.namespace == "agents"
    assert env.execute("echo ok").output == "ok\n"
    assert [p["metadata"]["namespace"] for p in emu.pods()] == ["agents"]
