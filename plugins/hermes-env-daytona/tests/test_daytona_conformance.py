"""The hermes-env conformance suite against the real daytona SDK and the local emulator,
with the service's latencies switched on: every request takes a network delay, exit
statuses come after the output, and output tails come after the exit status.
"""

from __future__ import annotations

import pytest

from hermes_env_core.testing import EnvironmentConformance


def realistic(emu) -> None:
    emu.latency = 0.01  # each way through the proxy: 20 ms a round trip
    emu.exit_status_delay = 0.05
    emu.output_after_exit = 0.05


class TestDaytonaConformance(EnvironmentConformance):
    """The default snapshot: the daemon runs commands with zsh (dash stands in here)."""

    # Every example is a round trip through the SDK and the emulator's HTTP server.
    hypothesis_examples = 25

    @pytest.fixture
    def environment(self, emu, make_env):
        realistic(emu)
        return make_env(timeout=60)


class TestDaytonaConformanceBashImage(EnvironmentConformance):
    """A sandbox whose daemon runs commands with bash (a Debian-based image such as python:3.12-slim)."""

    hypothesis_examples = 10

    @pytest.fixture
    def environment(self, emu, make_env):
        realistic(emu)
        return make_env(image="python:3.12-slim", timeout=60)
