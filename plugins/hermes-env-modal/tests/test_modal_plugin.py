"""The distribution as installed (``pip install -e plugins/hermes-env-modal``): found
by its entry point, and light (no SDK, no HTTP client) until a backend is created."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, entry_points

import pytest

from hermes_env_core.plugins import ENTRY_POINT_GROUP, BackendRegistry

INSTALL = "pip install -e plugins/hermes-env-modal"


def _require_installed() -> None:
    try:
        distribution("hermes-env-modal")
    except PackageNotFoundError:
        pytest.fail(f"hermes-env-modal is not installed in this Python: {INSTALL}")


def test_entry_point_names_the_light_plugin_module():
    _require_installed()
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == "modal"]
    assert [ep.value for ep in eps] == ["hermes_env_modal.plugin"]
    assert eps[0].dist is not None and eps[0].dist.metadata["Name"] == "hermes-env-modal"


def test_registry_finds_modal_from_its_distribution():
    _require_installed()
    registry = BackendRegistry()
    spec = registry.resolve("modal")
    assert spec.target == "hermes_env_modal.backend:ModalEnvironment"
    assert spec.distribution == "hermes-env-modal"
    model = registry.config_model("modal")
    assert "mode" in model.model_fields and "gateway_token" in model.model_fields


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


_HEAVY = ("modal", "grpclib", "synchronicity", "httpx", "aiohttp")


def test_plugin_and_config_import_no_sdk():
    _require_installed()
    seen = _run(
        "import json, sys\n"
        "import hermes_env_modal, hermes_env_modal.plugin, hermes_env_modal.config\n"
        "from hermes_env_core.plugins import BackendRegistry\n"
        "r = BackendRegistry(); r.resolve('modal'); r.config_model('modal')\n"
        "from hermes_env_modal.config import ModalConfig, resolve_mode\n"
        "try:\n    resolve_mode(ModalConfig(), {'MODAL_CONFIG_PATH': '/nonexistent'})\nexcept Exception: pass\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {_HEAVY!r})))\n"
    )
    assert seen == []


def test_managed_mode_never_imports_the_modal_sdk(gateway):
    seen = _run(
        "import json, sys\n"
        "from hermes_env_modal import ModalEnvironment\n"
        f"with ModalEnvironment(mode='managed', gateway_url={gateway.url!r}, gateway_token={gateway.token!r}) as e:\n"
        "    assert e.execute('echo hi').output == 'hi\\n'\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('modal', 'grpclib'))))\n"
    )
    assert seen == []
