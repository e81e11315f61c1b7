"""The installed distribution is found by entry point, stays light until used, and reads its config."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest
from hermes_env_daytona.backend import DaytonaEnvironment
from hermes_env_daytona.config import DaytonaConfig

from hermes_env_core import create_environment
from hermes_env_core.errors import ConfigError
from hermes_env_core.plugins import BackendRegistry


def test_entry_point_is_installed():
    eps = [ep for ep in importlib.metadata.entry_points(group="hermes_env") if ep.name == "daytona"]
    assert len(eps) == 1, "pip install -e plugins/hermes-env-daytona first"
    assert eps[0].value == "hermes_env_daytona.plugin"
    assert eps[0].dist is not None and eps[0].dist.metadata["Name"] == "hermes-env-daytona"


def test_registry_finds_the_backend_by_name():
    registry = BackendRegistry()
    spec = registry.resolve("daytona")
    assert spec.target == "hermes_env_daytona.backend:DaytonaEnvironment"
    assert spec.distribution == "hermes-env-daytona"
    assert registry.provider("daytona").distribution == "hermes-env-daytona"
    assert registry.config_model("daytona") is DaytonaConfig
    assert registry.load("daytona") is DaytonaEnvironment


def _run_python(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_listing_backends_and_reading_the_config_model_import_no_sdk():
    found = _run_python(
        """
        import json, sys
        from hermes_env_core.plugins import BackendRegistry
        registry = BackendRegistry()
        spec = registry.resolve("daytona")
        model = registry.config_model("daytona")
        model(task_id="x", image="debian:12", cpu=2)
        import hermes_env_daytona.plugin, hermes_env_daytona.config
        sdk = sorted(m for m in sys.modules if m == "daytona" or m.startswith(("daytona.", "daytona_")))
        print(json.dumps({"names": registry.names(), "sdk": sdk, "backend": "hermes_env_daytona.backend" in sys.modules}))
        """
    )
    assert "daytona" in found["names"]
    assert found["sdk"] == [] and found["backend"] is False


def test_the_sdk_is_imported_when_an_environment_is_created():
    found = _run_python(
        """
        import json, sys
        from hermes_env_core.plugins import BackendRegistry
        cls = BackendRegistry().load("daytona")
        loaded = "daytona" in sys.modules
        # Port 9 on loopback: nothing listens, and nothing is asked before a command runs.
        cls(task_id="x", api_key="k", api_url="http://127.0.0.1:9/api")
        print(json.dumps({"on_load": loaded, "on_create": "daytona" in sys.modules}))
        """
    )
    assert found == {"on_load": False, "on_create": True}


def test_create_environment_by_name_with_the_sdk_variables(emu, task_id):
    # DAYTONA_API_URL / DAYTONA_API_KEY point at the emulator (the emu fixture sets them).
    with create_environment("daytona", task_id=task_id, timeout=30) as env:
        assert isinstance(env, DaytonaEnvironment)
        assert env.execute("echo via-factory").output == "via-factory\n"
    (record,) = emu.sandboxes.values()
    assert record.name == f"hermes-{task_id}" and record.state == "stopped"


def test_terminal_variables_configure_the_backend(emu, monkeypatch, task_id):
    monkeypatch.setenv("TERMINAL_ENV", "daytona")
    monkeypatch.setenv("TERMINAL_SANDBOX_NAME", "from-env")
    monkeypatch.setenv("TERMINAL_LABELS", '{"via": "env"}')
    monkeypatch.setenv("TERMINAL_PERSISTENT", "false")
    with create_environment(task_id=task_id) as env:
        env.execute("true")
        (record,) = emu.sandboxes.values()
        assert record.name == "from-env" and record.labels["via"] == "env"
    assert emu.sandboxes == {}


def test_config_validation():
    with pytest.raises(ValueError, match="either image or snapshot"):
        DaytonaConfig(image="a", snapshot="b")
    with pytest.raises(ValueError, match="only to sandboxes created from an image"):
        DaytonaConfig(cpu=2)
    with pytest.raises(ValueError, match="sandbox_name"):
        DaytonaConfig(sandbox_name="no spaces")
    with pytest.raises(ValueError, match="extra"):
        DaytonaConfig(no_such_option=1)
    assert "secret" not in repr(DaytonaConfig(api_key="secret"))


def test_unknown_option_is_a_config_error_naming_it(emu):
    with pytest.raises(ConfigError, match="unknown option 'imgae'.*did you mean 'image'"):
        create_environment("daytona", imgae="debian:12")


def test_check_requirements(monkeypatch):
    monkeypatch.setenv("DAYTONA_API_KEY", "k")
    assert DaytonaEnvironment.check_requirements() == []
    for var in ("DAYTONA_API_KEY", "TERMINAL_API_KEY", "DAYTONA_JWT_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    (problem,) = DaytonaEnvironment.check_requirements()
    assert "DAYTONA_API_KEY" in problem
