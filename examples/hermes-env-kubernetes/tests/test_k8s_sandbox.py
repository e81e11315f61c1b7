"""agent-sandbox mode: a SandboxClaim from a SandboxTemplate or a warm pool, exec into its Sandbox's pod."""

from __future__ import annotations

import os
from typing import Any

import pytest

from hermes_env_core.errors import EnvironmentUnavailable
from hermes_env_core.testing import wait_until

EXT = "extensions.agents.x-k8s.io"


@pytest.fixture
def custom(emu: Any) -> Any:
    from kubernetes import client, config

    return client.CustomObjectsApi(config.new_client_from_config(config_file=os.environ["KUBECONFIG"]))


def _template(custom: Any, image: str, name: str = "python-agent") -> None:
    custom.create_namespaced_custom_object(EXT, "v1alpha1", "default", "sandboxtemplates", {
        "apiVersion": f"{EXT}/v1alpha1", "kind": "SandboxTemplate", "metadata": {"name": name},
        "spec": {"podTemplate": {"metadata": {"labels": {"from": "template"}}, "spec": {"containers": [
            {"name": "main", "image": image, "command": ["sh", "-c", "trap 'exit 0' TERM; sleep infinity & wait"]}]}}},
    })


def test_claim_from_template(emu: Any, make_env: Any, custom: Any, test_image: str) -> None:
    _template(custom, test_image)
    env = make_env(sandbox_template="python-agent")
    env.execute("export A=1")
    assert env.execute("echo $A; hostname").output == f"1\n{env.pod_name}\n"
    (claim,) = emu.store.list("sandboxclaims", "default")
    assert claim["spec"] == {"sandboxTemplateRef": {"name": "python-agent"}}
    assert claim["apiVersion"] == f"{EXT}/v1alpha1"
    (pod,) = emu.pods()
    assert pod["metadata"]["labels"]["from"] == "template"
    env.close()
    assert emu.store.list("sandboxclaims", "default") == [] and emu.store.list("sandboxes", "default") == []
    assert wait_until(lambda: emu.pods() == [], timeout=20)


def test_claim_from_warm_pool_adopts_a_ready_pod(emu: Any, make_env: Any, custom: Any, test_image: str) -> None:
    _template(custom, test_image)
    custom.create_namespaced_custom_object(EXT, "v1beta1", "default", "sandboxwarmpools", {
        "apiVersion": f"{EXT}/v1beta1", "kind": "SandboxWarmPool", "metadata": {"name": "pool"},
        "spec": {"replicas": 1, "sandboxTemplateRef": {"name": "python-agent"}}})
    assert wait_until(lambda: [p["status"]["phase"] for p in emu.pods()] == ["Running"], timeout=30)
    (warm,) = emu.pods()
    env = make_env(sandbox_warm_pool="pool")
    assert env.execute("echo ok").output == "ok\n"
    assert env.pod_name == warm["metadata"]["name"] != env.claim_name  # found through agents.x-k8s.io/pod-name
    (claim,) = emu.store.list("sandboxclaims", "default")
    assert claim["spec"] == {"warmPoolRef": {"name": "pool"}} and claim["apiVersion"] == f"{EXT}/v1beta1"
    env.close()
    assert wait_until(lambda: warm["metadata"]["name"] not in [p["metadata"]["name"] for p in emu.pods()], timeout=20)


def test_missing_template_is_a_clear_error(emu: Any, make_env: Any) -> None:
    env = make_env(sandbox_template="nope")
    with pytest.raises(EnvironmentUnavailable, match='SandboxTemplate "nope" not found'):
        env.execute("true")
    assert emu.store.list("sandboxclaims", "default") == []  # the failed claim is deleted


def test_rbac_on_claims_names_the_verbs(emu: Any, make_env: Any, custom: Any, test_image: str) -> None:
    _template(custom, test_image)
    emu.deny("create", "sandboxclaims")
    with pytest.raises(EnvironmentUnavailable) as info:
        make_env(sandbox_template="python-agent").execute("true")
    msg = str(info.value)
    assert 'cannot create resource "sandboxclaims" in API group "extensions.agents.x-k8s.io"' in msg
    assert "sandboxclaims: create, get, delete" in msg


def test_lost_sandbox_pod_gives_a_new_claim(emu: Any, make_env: Any, custom: Any, test_image: str) -> None:
    _template(custom, test_image)
    env = make_env(sandbox_template="python-agent")
    env.execute("K=v")
    first_claim, first_pod = env.claim_name, env.pod_name
    emu.delete_pod("default", first_pod, 0)
    assert wait_until(lambda: first_pod not in [p["metadata"]["name"] for p in emu.pods()], timeout=20)
    assert env.execute("echo $K").output == "v\n"
    assert env.claim_name != first_claim
    assert [c["metadata"]["name"] for c in emu.store.list("sandboxclaims", "default")] == [env.claim_name]
