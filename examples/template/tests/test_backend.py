"""The __NAME__ backend against the hermes-env conformance suite, created by name as users create it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hermes_env_core import BaseEnvironment, create_environment
from hermes_env_core.testing import EnvironmentConformance


class Test__CLASS__Conformance(EnvironmentConformance):
    # What the backend cannot do, with why: those tests must then raise UnsupportedOperation.
    unsupported = {}  # such as {"large_stdin": "the API limits a request to 64 kB"}
    # Suite tests this class overrides, with why (an override without one fails the class).
    overrides = {}

    @pytest.fixture
    def environment(self) -> Iterator[BaseEnvironment]:
        with create_environment("__NAME__") as env:
            yield env
