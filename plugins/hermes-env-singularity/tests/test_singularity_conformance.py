"""The core's conformance suite against a real Apptainer instance."""

from __future__ import annotations

import pytest
from hermes_env_singularity.backend import SingularityEnvironment

from hermes_env_core.testing import EnvironmentConformance


class TestSingularityConformance(EnvironmentConformance):
    """Through the resident shell channel (the default)."""

    @pytest.fixture
    def environment(self, sif):
        with SingularityEnvironment(image=str(sif), timeout=60, channel=True) as env:
            yield env
            assert env.channel_mode == "channel"


class TestSingularityProcessConformance(EnvironmentConformance):
    """One ``apptainer exec`` per command (the fallback path)."""

    @pytest.fixture
    def environment(self, sif):
        with SingularityEnvironment(image=str(sif), timeout=60, channel=False) as env:
            yield env
