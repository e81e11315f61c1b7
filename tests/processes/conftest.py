"""Fixtures for the background-process tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.processes import ProcessRegistry
from tests.processes.bgsupport import make_registry


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[ProcessRegistry]:
    reg = make_registry(tmp_path)
    try:
        yield reg
    finally:
        reg.close()


@pytest.fixture
def local_env() -> Iterator[BaseEnvironment]:
    with LocalEnvironment(timeout=60) as env:
        yield env


@pytest.fixture
def marker() -> str:
    """A word unique to this test, to find its processes by command line."""
    return "hermesbg" + uuid.uuid4().hex[:10]
