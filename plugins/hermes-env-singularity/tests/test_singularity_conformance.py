"""The core's conformance suite against a real Apptainer instance."""

from __future__ import annotations

import pytest
from hermes_env_singularity.backend import SingularityEnvironment

from hermes_env_core.testing import EnvironmentConformance


class TestSingularityConformance(EnvironmentConformance):
    @pytest.fixture
    def environment(self, sif):
        with SingularityEnvironment(image=str(sif), timeout=60) as env:
            yield env
