"""The __NAME__ backend against the hermes-env conformance suite, created by name as users create it."""

from __future__ import annotations

import pytest

from hermes_env_core import create_environment
from hermes_env_core.testing import EnvironmentConformance


class Test__CLASS__Conformance(EnvironmentConformance):
    # What the backend cannot do, with why: those tests must then raise UnsupportedOperation.
    unsupported: dict[str, str] = {}
    # Suite tests this class overrides, with why (an override without one fails the class).
    overrides: dict[str, str] = {}

    @pytest.fixture
    def environment(self):
        with create_environment("__NAME__") as env:
            yield env
