"""Opt-in: the backend against the real Daytona service. Runs only when DAYTONA_API_KEY is set.

Creates one sandbox (from the default snapshot unless HERMES_ENV_DAYTONA_LIVE_IMAGE is
set), runs the conformance suite in it with a fresh session per test, checks stop and
resume, and deletes it at the end. Costs a few minutes of sandbox time.
"""

from __future__ import annotations

import os
import uuid

import pytest
from hermes_env_daytona.backend import DaytonaEnvironment

from hermes_env_core.testing import EnvironmentConformance

pytestmark = [pytest.mark.live]  # collected only when DAYTONA_API_KEY is set (conftest.py)

_IMAGE = os.environ.get("HERMES_ENV_DAYTONA_LIVE_IMAGE") or None


class _Shared(DaytonaEnvironment):
    """Leaves the shared sandbox running when one test's environment is closed."""

    def cleanup(self) -> None:
        dispatcher = getattr(self._client, "_event_dispatcher", None)
        if dispatcher is not None:
            dispatcher.disconnect()


@pytest.fixture(scope="module")
def live_sandbox_name():
    name = f"hermes-live-{uuid.uuid4().hex[:10]}"
    yield name
    with DaytonaEnvironment(sandbox_name=name, persistent=False, image=_IMAGE) as env:
        env.execute("true")  # resumes it if a test left it stopped; close() deletes it


class TestDaytonaLiveConformance(EnvironmentConformance):
    hypothesis_examples = 5
    timing_slack = 6.0

    @pytest.fixture
    def environment(self, live_sandbox_name):
        with _Shared(sandbox_name=live_sandbox_name, image=_IMAGE, timeout=120, task_id=uuid.uuid4().hex[:8]) as env:
            yield env


def test_live_stop_and_resume(live_sandbox_name):
    with DaytonaEnvironment(sandbox_name=live_sandbox_name, image=_IMAGE) as env:
        env.execute("echo kept > ~/hermes-live-marker")
        sandbox_id = env.sandbox.id
    # close() stopped it (persistent); a new environment of that name resumes it
    with _Shared(sandbox_name=live_sandbox_name, image=_IMAGE) as env:
        r = env.execute("cat ~/hermes-live-marker")
        assert r.output == "kept\n"
        assert env.sandbox.id == sandbox_id
        assert any("resumed" in n for n in r.notes)
