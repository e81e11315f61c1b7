"""Fixtures: a real Docker engine, the test image, and the Kubernetes API emulator in front of them.

The emulator and the core's Docker helpers are loaded by file path under
private module names, so these tests run alone or next to other suites.
The live test runs only with HERMES_ENV_K8S_LIVE=1 (and a KUBECONFIG).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = Path(os.environ.get("HERMES_ENV_TEST_ROOT") or HERE.parents[2])

collect_ignore = [] if os.environ.get("HERMES_ENV_K8S_LIVE") == "1" else ["test_k8s_live.py"]


def _load(name: str, path: Path, package: bool = False) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, path / "__init__.py" if package else path, submodule_search_locations=[str(path)] if package else None
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_emulator() -> Any:
    return _load("hermes_env_k8s_tests_emulator", HERE / "emulator", package=True)


def docker_support() -> Any:
    return _load("hermes_env_k8s_tests_docker_engine", REPO_ROOT / "tests" / "support" / "docker_engine.py")


@pytest.fixture(scope="session")
def docker_client() -> Any:
    return docker_support().ensure_engine()


@pytest.fixture(scope="session")
def test_image(docker_client: Any) -> str:
    return str(docker_support().ensure_test_image(docker_client))


@pytest.fixture
def emu(docker_client: Any, test_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A running emulator; KUBECONFIG points at it (TLS with its own CA, bearer token)."""
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with load_emulator().KubeEmulator(docker_client) as emulator:
        monkeypatch.setenv("KUBECONFIG", emulator.write_kubeconfig(str(tmp_path / "kubeconfig")))
        yield emulator


@pytest.fixture
def make_env(emu: Any, test_image: str) -> Any:
    """Build KubernetesEnvironments against the emulator; all are closed at the end of the test."""
    from hermes_env_kubernetes.backend import KubernetesEnvironment

    made = []

    def make(**options: Any) -> Any:
        options.setdefault("task_id", "t" + uuid.uuid4().hex[:10])
        options.setdefault("image", test_image)
        options.setdefault("timeout", 60)
        options.setdefault("start_timeout", 60)
        env = KubernetesEnvironment(**options)
        made.append(env)
        return env

    yield make
    for env in made:
        try:
            env.close()
        except Exception:  # noqa: BLE001, S110 - a test may have broken it on purpose
            pass
