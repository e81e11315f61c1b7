"""The whole hermes-env contract, through the exec websocket of the Kubernetes API emulator.

The suite runs on the session server (one long-lived exec; v5, then an API
server that offers only v4) and with ``channel=False`` (one exec per command).
"""

from __future__ import annotations

from typing import Any

import pytest

from hermes_env_core.environment.options import EnvironmentConfig
from hermes_env_core.testing import EnvironmentConformance

HAS_CHANNEL = "channel" in EnvironmentConfig.model_fields


class TestKubernetesConformance(EnvironmentConformance):
    hypothesis_examples = 15

    @pytest.fixture
    def environment(self, make_env: Any) -> Any:
        env = make_env()
        yield env
        assert env.session_mode == "server"  # the session lives in one exec stream of the pod


class TestKubernetesConformanceV4(EnvironmentConformance):
    """An API server without v5: the session server never half-closes its stream; helpers bound stdin by length."""

    hypothesis_examples = 10

    @pytest.fixture
    def environment(self, emu: Any, make_env: Any) -> Any:
        emu.exec_protocols = ("v4.channel.k8s.io",)
        env = make_env()
        yield env
        assert env.session_mode == "server"
        assert {e["protocol"] for e in emu.exec_log} <= {"v4.channel.k8s.io"}


if HAS_CHANNEL:

    class TestKubernetesConformanceNoChannel(EnvironmentConformance):
        """One exec per command (v5), as when the channel is turned off."""

        hypothesis_examples = 10

        @pytest.fixture
        def environment(self, make_env: Any) -> Any:
            env = make_env(channel=False)
            yield env
            assert env.channel_mode.startswith("process")
