"""The whole hermes-env contract, through the exec websocket of the Kubernetes API emulator.

Where the core has the resident channel (the ``channel`` option), the suite
runs twice: through the channel (one long-lived exec), and one exec per command.
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
        if HAS_CHANNEL:
            assert env.channel_mode == "channel"  # a silently refused channel fails here


class TestKubernetesConformanceV4(EnvironmentConformance):
    """A server without v5: stdin cannot be half-closed, so it is bounded by length instead."""

    hypothesis_examples = 10

    @pytest.fixture
    def environment(self, emu: Any, make_env: Any) -> Any:
        emu.exec_protocols = ("v4.channel.k8s.io",)
        env = make_env(**({"channel": False} if HAS_CHANNEL else {}))
        yield env
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
