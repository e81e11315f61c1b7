"""The whole hermes-env contract, through the exec websocket of the Kubernetes API emulator."""

from __future__ import annotations

from typing import Any

import pytest

from hermes_env_core.testing import EnvironmentConformance


class TestKubernetesConformance(EnvironmentConformance):
    hypothesis_examples = 15

    @pytest.fixture
    def environment(self, make_env: Any) -> Any:
        return make_env()


class TestKubernetesConformanceV4(EnvironmentConformance):
    """A server without v5: stdin cannot be half-closed, so it is bounded by length instead."""

    hypothesis_examples = 10

    @pytest.fixture
    def environment(self, emu: Any, make_env: Any) -> Any:
        emu.exec_protocols = ("v4.channel.k8s.io",)
        env = make_env()
        yield env
        assert {e["protocol"] for e in emu.exec_log} <= {"v4.channel.k8s.io"}
