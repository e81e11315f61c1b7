"""The hermes-env conformance suite against the real daytona SDK and the local emulator."""

from __future__ import annotations

import pytest

from hermes_env_core.testing import EnvironmentConformance


class TestDaytonaConformance(EnvironmentConformance):
    """The default snapshot: the daemon runs commands with zsh (dash stands in here)."""

    # Every example is a round trip through the SDK and the emulator's HTTP server.
    hypothesis_examples = 25

    @pytest.fixture
    def environment(self, make_env):
        return make_env(timeout=60)


class TestDaytonaConformanceBashImage(EnvironmentConformance):
    """A sandbox whose daemon runs commands with bash (a Debian-based image such as python:3.12-slim)."""

    hypothesis_examples = 10

    @pytest.fixture
    def environment(self, make_env):
        return make_env(image="python:3.12-slim", timeout=60)
