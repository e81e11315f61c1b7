"""The conformance suite against the Docker backend and a real engine.

Every test gets a fresh environment (fresh shell state) on one persistent
container shared by the module, which also exercises reuse by task id.
"""

from __future__ import annotations

import os

import pytest

from hermes_env_core.backends.docker import DockerEnvironment
from hermes_env_core.testing import EnvironmentConformance

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def docker_conformance_task(docker_image):
    task = f"conformance-{os.getpid()}"
    yield task
    DockerEnvironment(image=docker_image, pull="never", task_id=task, persistent=True).cleanup(force=True)


class TestDockerConformance(EnvironmentConformance):
    """Through the resident shell channel (the default)."""

    @pytest.fixture
    def environment(self, docker_image, docker_conformance_task):
        with DockerEnvironment(
            image=docker_image, pull="never", task_id=docker_conformance_task, persistent=True, timeout=60,
            channel=True,
        ) as env:
            yield env
            assert env.channel_mode == "channel"


class TestDockerProcessConformance(EnvironmentConformance):
    """One exec per command (the fallback path)."""

    @pytest.fixture
    def environment(self, docker_image, docker_conformance_task):
        with DockerEnvironment(
            image=docker_image, pull="never", task_id=docker_conformance_task, persistent=True, timeout=60,
            channel=False,
        ) as env:
            yield env
