"""The hermes-env conformance suite against the real daytona SDK and the local emulator."""

from __future__ import annotations

import pytest

from hermes_env_core.testing import EnvironmentConformance


class TestDaytonaConformance(EnvironmentConformance):
    """The sandbox runs commands with bash, as the emulator does by default: scripts run in it directly."""

    # Every example is a round trip through the SDK and the emulator's HTTP server.
    hypothesis_examples = 25

    @pytest.fixture
    def environment(self, make_env):
        return make_env(timeout=60)


class TestDaytonaConformanceNonBashShell(EnvironmentConformance):
    """The sandbox runs commands with another shell (zsh in Daytona's default snapshots): ``exec bash -c``."""

    hypothesis_examples = 10

    @pytest.fixture
    def environment(self, emu, make_env):
        emu.exec_shell = "sh"
        env = make_env(timeout=60)
        env.execute("true")
        assert env._shells == {env.sandbox.id: False}
        return env
