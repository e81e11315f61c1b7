"""The core conformance suite, unchanged, against direct mode: the real modal SDK
driving sandboxes of the local gRPC emulator, with realistic latencies on (round
trips, an exit status that comes late, output that trails it)."""

from __future__ import annotations

import uuid

import pytest
from hermes_env_modal import ModalEnvironment

from hermes_env_core.testing import EnvironmentConformance


class TestModalDirectConformance(EnvironmentConformance):
    hypothesis_examples = 15  # each example is a round trip through the SDK
    # The kill path signals bash's tree from bash's pid; a child that outlives
    # bash after SIGTERM, or that called setsid, escapes it (issue 11, point 3).
    known_gaps = {
        "test_timeout_kills_a_child_that_ignores_term_after_bash_exited": "kill path loses children once bash exits",
        "test_timeout_kills_a_setsid_descendant": "kill path does not follow setsid descendants",
        # Emulator artefact, not the backend: sandboxes here share this host's /tmp and
        # /dev/shm, so the test's harvest reads every hermes-env-* directory that every
        # test run on the machine left there and can outlast its 120 s timeout.
        "test_child_cannot_forge_a_frame": "emulator sandboxes share the host's /tmp: the harvest may time out",
    }

    @pytest.fixture
    def environment(self, realistic_modal_emu):
        with ModalEnvironment(mode="direct", task_id=f"conf-{uuid.uuid4().hex[:8]}") as env:
            yield env
