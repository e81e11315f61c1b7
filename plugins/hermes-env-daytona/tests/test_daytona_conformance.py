"""The hermes-env conformance suite against the real daytona SDK and the local emulator."""

from __future__ import annotations

import pytest

from hermes_env_core.testing import EnvironmentConformance


class TestDaytonaConformance(EnvironmentConformance):
    # Every example is a round trip through the SDK and the emulator's HTTP server.
    hypothesis_examples = 25

    @pytest.fixture
    def environment(self, make_env):
        return make_env(timeout=60)
