"""Opt-in: the backend against the real Daytona service.

Collected only when ``DAYTONA_API_KEY`` is set (``conftest.py``), so CI without
credentials neither runs nor skips them. Creates a few sandboxes (a bash image,
``HERMES_ENV_DAYTONA_LIVE_IMAGE``, default ``python:3.12-slim``; the default
snapshot, whose daemon shell is zsh; an image without bash) and deletes them at
the end. Costs some minutes of sandbox time; the auto-stop test alone waits
for the service to stop an idle sandbox (one to three minutes).
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from hermes_env_daytona.backend import DaytonaEnvironment

from hermes_env_core.errors import BackendError, EnvironmentUnavailable
from hermes_env_core.testing import EnvironmentConformance

pytestmark = [pytest.mark.live]

_IMAGE = os.environ.get("HERMES_ENV_DAYTONA_LIVE_IMAGE") or "python:3.12-slim"


class _Shared(DaytonaEnvironment):
    """Leaves the shared sandbox running when one test's environment is closed."""

    def cleanup(self) -> None:
        dispatcher = getattr(self._client, "_event_dispatcher", None)
        if dispatcher is not None:
            dispatcher.disconnect()


def _delete(name: str, **options) -> None:
    with DaytonaEnvironment(sandbox_name=name, persistent=False, **options) as env:
        env.execute("true")  # resumes it if a test left it stopped or archived; close() deletes it


@pytest.fixture(scope="module")
def live_sandbox_name():
    name = f"hermes-live-{uuid.uuid4().hex[:10]}"
    yield name
    _delete(name, image=_IMAGE)


class TestDaytonaLiveConformance(EnvironmentConformance):
    """The whole suite in a sandbox whose daemon runs commands with bash."""

    hypothesis_examples = 5
    timing_slack = 6.0

    @pytest.fixture
    def environment(self, live_sandbox_name):
        with _Shared(sandbox_name=live_sandbox_name, image=_IMAGE, timeout=120, task_id=uuid.uuid4().hex[:8]) as env:
            yield env


def test_live_bash_image_runs_the_whole_script(live_sandbox_name):
    with _Shared(sandbox_name=live_sandbox_name, image=_IMAGE) as env:
        r = env.execute("echo hello; exit 3")
        assert (r.output, r.exit_code) == ("hello\n", 3)
        assert env.execute("echo one\necho two").output == "one\ntwo\n"


def test_live_long_command_outlasts_proxy_timeouts(live_sandbox_name):
    # Longer than the idle timeouts of common load balancers (60 s): no request lasts that long.
    with _Shared(sandbox_name=live_sandbox_name, image=_IMAGE, timeout=300) as env:
        r = env.execute("echo run >> ~/hermes-live-runs; sleep 75; echo done")
        assert (r.output, r.exit_code) == ("done\n", 0)
        assert env.execute("grep -c run ~/hermes-live-runs").output == "1\n"  # ran once


def test_live_signal_killed_helper_is_an_error(live_sandbox_name):
    with _Shared(sandbox_name=live_sandbox_name, image=_IMAGE) as env:
        env.execute("true")
        with pytest.raises(BackendError, match="exit code -1"):
            env.run_script("kill -KILL $$", "a helper")


def test_live_stop_archive_and_resume(live_sandbox_name):
    with DaytonaEnvironment(sandbox_name=live_sandbox_name, image=_IMAGE) as env:
        env.execute("echo kept > ~/hermes-live-marker")
        sandbox_id = env.sandbox.id
    # close() stopped it (persistent): a new environment of that name resumes it.
    with DaytonaEnvironment(sandbox_name=live_sandbox_name, image=_IMAGE) as env:
        r = env.execute("cat ~/hermes-live-marker")
        assert r.output == "kept\n"
        assert env.sandbox.id == sandbox_id
        assert any("resumed" in n for n in r.notes)
        sb = env.sandbox
    sb.refresh_data()
    sb.archive()  # returns while it is still archiving
    with _Shared(sandbox_name=live_sandbox_name, image=_IMAGE, start_timeout=600) as env:
        r = env.execute("cat ~/hermes-live-marker")
        assert r.output == "kept\n"
        assert any("archived" in n for n in r.notes)


def test_live_auto_stopped_sandbox_comes_back(live_sandbox_name):
    with _Shared(sandbox_name=live_sandbox_name, image=_IMAGE, auto_stop_interval=1) as env:
        env.execute("cd /tmp && export LIVE_KEPT=1")
        sb = env.sandbox
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # the service stops it after a minute or so idle
            time.sleep(15)
            sb.refresh_data()
            if str(getattr(sb.state, "value", sb.state)) in ("stopped", "archived"):
                break
        else:
            pytest.fail("the sandbox was not auto-stopped within 10 minutes")
        r = env.execute("echo $PWD $LIVE_KEPT")
        assert r.output == "/tmp 1\n"
        assert any("restarted" in n for n in r.notes)
        env.execute("true")
        sb.set_autostop_interval(15)


def test_live_default_snapshot_runs_commands_through_zsh():
    name = f"hermes-live-{uuid.uuid4().hex[:10]}"
    try:
        with DaytonaEnvironment(sandbox_name=name) as env:
            assert env.sandbox.process.exec("echo $ZSH_VERSION").result.strip()  # the daemon's shell is zsh
            r = env.execute("echo hello; exit 3")
            assert (r.output, r.exit_code) == ("hello\n", 3)
    finally:
        _delete(name)


def test_live_image_without_bash_is_a_clear_error():
    name = f"hermes-live-{uuid.uuid4().hex[:10]}"
    env = DaytonaEnvironment(sandbox_name=name, image="alpine:3.20", persistent=False)
    try:
        with pytest.raises(EnvironmentUnavailable, match="has no bash"):
            env.execute("true")
    finally:
        env.close()
