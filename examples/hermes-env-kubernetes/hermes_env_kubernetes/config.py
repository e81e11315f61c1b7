"""Options of the ``kubernetes`` backend, as users type them (no SDK import here)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from hermes_env_core.config import MemorySize
from hermes_env_core.environment.options import EnvironmentConfig
from hermes_env_core.sync import SyncOption


class KubernetesConfig(EnvironmentConfig):
    """Where and how the pod runs. Unknown keys are rejected."""

    kubeconfig: str | None = Field(None, description="Kubeconfig file; default KUBECONFIG, ~/.kube/config, in-cluster.")
    context: str | None = Field(None, description="Kubeconfig context (default: its current-context).")
    namespace: str | None = Field(None, description="Namespace (default: the context's, else 'default').")
    image: str = Field("debian:bookworm-slim", description="Container image; it needs bash (and tar for sync).")
    cpu: float | None = Field(None, gt=0, description="CPU request and limit in cores (0.5, 2).")
    memory: MemorySize | None = Field(None, description="Memory request and limit, such as '512m' or '2g'.")
    ephemeral_storage: str | None = Field(None, description="Ephemeral storage request and limit ('1Gi').")
    service_account: str | None = Field(None, description="serviceAccountName of the pod.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pod must land on.")
    tolerations: tuple[dict[str, Any], ...] = Field((), description="Pod tolerations, as in a pod spec.")
    runtime_class: str | None = Field(None, description="runtimeClassName, e.g. 'gvisor' or 'kata'.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    image_pull_secrets: tuple[str, ...] = Field((), description="Names of image pull secrets.")
    pod_overlay: dict[str, Any] = Field(default_factory=dict, description="Merged into the pod manifest last.")
    start_timeout: float = Field(180.0, gt=0, description="Seconds for the pod to become Running.")
    keepalive_s: float = Field(20.0, gt=0, description="Websocket ping interval on a quiet exec stream.")
    sandbox_template: str | None = Field(None, description="agent-sandbox: claim from this SandboxTemplate.")
    sandbox_warm_pool: str | None = Field(None, description="agent-sandbox: claim from this SandboxWarmPool.")
    sync: tuple[SyncOption, ...] = Field((), description="Host paths pushed before each command, pulled at close.")
    sync_interval_s: float = Field(5.0, ge=0, description="Seconds between two checks of the host trees.")
    pull_on_close: bool = Field(True, description="Pull the pod's changes to synced paths back at close.")

    @model_validator(mode="after")
    def _one_source(self) -> KubernetesConfig:
        if self.sandbox_template and self.sandbox_warm_pool:
            raise ValueError("give sandbox_template or sandbox_warm_pool, not both")
        return self
