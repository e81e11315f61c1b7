"""Background processes inside a container of a real Docker engine (the sandbox path)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hermes_env_core.environment.base import BaseEnvironment
from tests.processes.bgsupport import docker_env
from tests.processes.suite import BackgroundSuite

pytestmark = pytest.mark.docker


class TestDocker(BackgroundSuite):
    exit_latency_s = 0.5

    @pytest.fixture
    def env(self) -> Iterator[BaseEnvironment]:
        with docker_env() as env:
            # The test image may lack script(1): then pty=True must say so.
            self.pty_supported = env.execute("command -v script").exit_code == 0
            yield env

    def make_env(self, request: pytest.FixtureRequest, **options: object) -> BaseEnvironment:
        if options.pop("reuse", False):
            env = docker_env(persistent=True, task_id=self._task_id)
            request.addfinalizer(lambda: env.cleanup(force=True))
        else:
            env = docker_env()
        request.addfinalizer(env.close)
        return env

    def owner_spec(self, request: pytest.FixtureRequest) -> dict[str, object]:
        import uuid

        from tests.support.docker_engine import ensure_engine, ensure_test_image

        self._task_id = "hbg-" + uuid.uuid4().hex[:8]
        image = ensure_test_image(ensure_engine())
        return {"backend": "docker", "options": {"image": image, "persistent": True, "task_id": self._task_id}}
