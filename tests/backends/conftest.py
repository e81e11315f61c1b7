"""Fixtures shared by the backend tests (append yours; keep names backend-prefixed)."""

from __future__ import annotations

import pytest

from tests.support.docker_engine import ensure_engine, ensure_test_image


# -- docker -----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def docker_client():
    """A ``docker.DockerClient`` on a running engine (started if needed; a failure in CI)."""
    return ensure_engine()


@pytest.fixture(scope="session")
def docker_image(docker_client) -> str:
    """The small offline test image, built from the host's binaries."""
    return ensure_test_image(docker_client)
