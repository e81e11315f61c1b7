"""The example backend against the hermes-env conformance suite, found by name as users find it."""

from __future__ import annotations

import pytest

from hermes_env_core import create_environment
from hermes_env_core.testing import EnvironmentConformance


class TestExampleConformance(EnvironmentConformance):
    @pytest.fixture
    def environment(self, tmp_path):
        with create_environment("example", root=str(tmp_path)) as env:
            yield env
