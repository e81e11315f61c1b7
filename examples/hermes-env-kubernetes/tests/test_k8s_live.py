"""Against a real cluster: opt-in (HERMES_ENV_K8S_LIVE=1; conftest does not collect this file otherwise).

Uses KUBECONFIG (or ~/.kube/config, or in-cluster) and the image in
HERMES_ENV_K8S_IMAGE (default debian:bookworm-slim, which has bash and tar).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from hermes_env_core.testing import EnvironmentConformance

IMAGE = os.environ.get("HERMES_ENV_K8S_IMAGE", "debian:bookworm-slim")
NAMESPACE = os.environ.get("HERMES_ENV_K8S_NAMESPACE") or None


def _env(**options: Any) -> Any:
    from hermes_env_kubernetes.backend import KubernetesEnvironment

    return KubernetesEnvironment(image=IMAGE, namespace=NAMESPACE, task_id="live" + uuid.uuid4().hex[:8],
                                 start_timeout=300, **options)


class TestKubernetesLive(EnvironmentConformance):
    hypothesis_examples = 5
    timing_slack = 5.0

    @pytest.fixture
    def environment(self) -> Any:
        with _env() as env:
            yield env


def test_live_sync_round_trip(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    with _env(sync=({"host": str(tmp_path), "remote": "/tmp/live-sync"},), sync_interval_s=0) as env:
        assert env.execute("cat /tmp/live-sync/in.txt").output == "hello\n"
        env.execute("echo back > /tmp/live-sync/out.txt")
    assert (tmp_path / "out.txt").read_text() == "back\n"
