"""The core conformance suite, unchanged, against managed mode: the gateway
client over HTTP to the emulator of the seed system's gateway contract (real
local processes behind it), with a 20 ms round trip on every request."""

from __future__ import annotations

import uuid

import pytest
from hermes_env_modal import ModalEnvironment

from hermes_env_core.testing import EnvironmentConformance


class TestModalManagedConformance(EnvironmentConformance):
    hypothesis_examples = 15
    # Managed mode has its own execute(): no timeout validation, and a raising
    # on_output callback does not stop the command (issue 11, points 3 and 5).
    known_gaps = {
        "test_timeout_must_be_positive": "managed execute() does not validate timeout",
        "test_raising_output_callback_stops_the_command": "managed execute() does not stop the command",
        "test_timeout_kills_a_child_that_ignores_term_after_bash_exited": "gateway kill path",
        "test_timeout_kills_a_setsid_descendant": "gateway kill path",
    }

    @pytest.fixture
    def environment(self, realistic_gateway):
        with ModalEnvironment(
            mode="managed",
            gateway_url=realistic_gateway.url,
            gateway_token=realistic_gateway.token,
            task_id=f"mconf-{uuid.uuid4().hex[:8]}",
        ) as env:
            yield env
