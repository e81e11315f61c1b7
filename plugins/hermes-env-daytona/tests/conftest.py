"""Fixtures for the Daytona plugin's tests: the emulator, and environments pointed at it.

The emulator package is loaded by file path under a private module name, so
these tests run alone (``python -m pytest plugins/hermes-env-daytona/tests``)
or next to other plugins' tests without a module name clash.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from pathlib import Path

import pytest

_EMULATOR_MODULE = "hermes_env_daytona_tests_emulator"

# The live tests talk to the real service: collected only when credentials are
# set, so that CI without them neither runs nor silently skips them.
collect_ignore = [] if os.environ.get("DAYTONA_API_KEY") else ["test_daytona_live.py"]


def pytest_configure(config):
    # Registered here too: run from the repository root, pytest reads the core's settings.
    config.addinivalue_line("markers", "live: talks to the real Daytona service (needs DAYTONA_API_KEY)")


def load_emulator():
    """The ``emulator`` package next to this file, imported once under a private name."""
    if _EMULATOR_MODULE in sys.modules:
        return sys.modules[_EMULATOR_MODULE]
    pkg_dir = Path(__file__).resolve().parent / "emulator"
    spec = importlib.util.spec_from_file_location(
        _EMULATOR_MODULE, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_EMULATOR_MODULE] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def emu(monkeypatch):
    """A running emulator; the SDK's variables point at it and no proxy is used."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    for var in ("DAYTONA_JWT_TOKEN", "DAYTONA_ORGANIZATION_ID", "DAYTONA_TARGET"):
        monkeypatch.delenv(var, raising=False)
    with load_emulator().DaytonaEmulator() as emulator:
        for key, value in emulator.sdk_env().items():
            monkeypatch.setenv(key, value)
        yield emulator


@pytest.fixture
def task_id() -> str:
    # Sandboxes of one emulator share this machine's /tmp: a unique task id keeps state files apart.
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def make_env(emu, task_id):
    """Build DaytonaEnvironments against the emulator; all are closed at the end of the test."""
    from hermes_env_daytona.backend import DaytonaEnvironment

    made = []

    def make(**options):
        options.setdefault("task_id", task_id)
        options.setdefault("timeout", 60)
        env = DaytonaEnvironment(**options)
        made.append(env)
        return env

    yield make
    for env in made:
        try:
            env.close()
        except Exception:  # noqa: BLE001, S110 - a test may have broken it on purpose
            pass
