"""The core conformance suite, unchanged, against managed mode: the gateway
client over HTTP to the gateway's emulator (real local bash behind it)."""

from __future__ import annotations

import uuid

import pytest
from hermes_env_modal import ModalEnvironment

from hermes_env_core.testing import EnvironmentConformance


class TestModalManagedConformance(EnvironmentConformance):
    hypothesis_examples = 15

    @pytest.fixture
    def environment(self, gateway):
        with ModalEnvironment(
            mode="managed",
            gateway_url=gateway.url,
            gateway_token=gateway.token,
            task_id=f"mconf-{uuid.uuid4().hex[:8]}",
        ) as env:
            yield env
