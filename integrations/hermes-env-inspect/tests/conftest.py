"""Fixtures: the Docker engine and the core's test image (helpers loaded by path), anyio on asyncio.

Tests run alone (``pytest integrations/hermes-env-inspect/tests``) with only
hermes-env-core and this distribution installed. No network: images are the
locally built test image, and the model is inspect's ``mockllm``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = Path(os.environ.get("HERMES_ENV_TEST_ROOT") or HERE.parents[2])


def _load(name: str, path: Path) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def docker_support() -> Any:
    return _load("hermes_env_inspect_tests_docker_engine", REPO_ROOT / "tests" / "support" / "docker_engine.py")


@pytest.fixture(scope="session")
def test_image() -> str:
    support = docker_support()
    return str(support.ensure_test_image(support.ensure_engine()))


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"
