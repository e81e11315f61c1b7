"""The versioned plugin API, through the installed console script: a plugin built for
another major version is refused at load, named with both versions and what to upgrade."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_env_core import API_VERSION
from hermes_env_core.plugins import BackendSpec
from hermes_env_core.plugins.spec import parse_api_version

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")
MAJOR = parse_api_version(API_VERSION)[0]


def plugin_modules(package: str, name: str, api_version: str | None) -> dict[str, str]:
    version_arg = "" if api_version is None else f", api_version={api_version!r}"
    return {
        f"{package}/__init__.py": "",
        f"{package}/plugin.py": f"""
            from hermes_env_core.plugins import BackendSpec, hookimpl

            @hookimpl
            def hermes_env_backends():
                return [BackendSpec(name={name!r}, target="{package}.backend:Env"{version_arg})]
        """,
        f"{package}/backend.py": f"""
            import tempfile
            from hermes_env_core import EnvironmentConfig, Target, TargetEnvironment
            from hermes_env_core.backends.local import start_bash

            class Here(Target):
                def __init__(self):
                    self.private = tempfile.mkdtemp()
                def start(self, request):
                    return start_bash(request)
                def state_dir(self):
                    return self.private
                def recover(self, why):
                    return False
                def release(self):
                    pass

            class Env(TargetEnvironment[EnvironmentConfig]):
                name = {name!r}
                def make_target(self, config):
                    return Here()
        """,
    }


def cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([HERMES_ENV, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def site(make_dist):
    make_dist("hermes-env-future", {"future": "hermes_env_future.plugin"},
              plugin_modules("hermes_env_future", "future", f"{MAJOR + 1}.0"), version="3.1")
    make_dist("hermes-env-ancient", {"ancient": "hermes_env_ancient.plugin"},
              plugin_modules("hermes_env_ancient", "ancient", f"{MAJOR - 1}.9"), version="0.2")
    make_dist("hermes-env-newer-minor", {"newerminor": "hermes_env_newerminor.plugin"},
              plugin_modules("hermes_env_newerminor", "newerminor", f"{MAJOR}.7"))
    make_dist("hermes-env-default", {"default": "hermes_env_default.plugin"},
              plugin_modules("hermes_env_default", "default", None))
    return make_dist("hermes-env-garbled", {"garbled": "hermes_env_garbled.plugin"},
                     plugin_modules("hermes_env_garbled", "garbled", "v2"))


def test_backends_lists_versions_and_refuses_other_majors(site):
    proc = cli(site, "backends", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["api_version"] == API_VERSION
    rows = {r["name"]: r for r in out["backends"]}
    assert rows["newerminor"]["api_version"] == f"{MAJOR}.7" and rows["newerminor"]["loadable"]
    assert rows["default"]["api_version"] == API_VERSION
    assert rows["local"]["api_version"] == API_VERSION
    assert not {"future", "ancient", "garbled"} & set(rows)
    failed = {f["distribution"]: f["error"] for f in out["failed_plugins"]}
    future = failed["hermes-env-future"]
    assert f"hermes-env-future 3.1 is built for hermes-env plugin API {MAJOR + 1}.0" in future
    assert f"provides plugin API {API_VERSION}" in future and "hermes-env-core" in future
    assert "upgrade hermes-env-core" in future
    ancient = failed["hermes-env-ancient"]
    assert f"hermes-env-ancient 0.2 is built for hermes-env plugin API {MAJOR - 1}.9" in ancient
    assert f"upgrade hermes-env-ancient to a release built for plugin API {MAJOR}.x" in ancient
    assert "pip install -U hermes-env-ancient" in ancient
    assert "'v2' is not of the form MAJOR.MINOR" in failed["hermes-env-garbled"]


def test_backends_text_shows_the_api_column_and_the_refusal(site):
    proc = cli(site, "backends")
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0].split()
    assert header == ["NAME", "ALIASES", "DISTRIBUTION", "VERSION", "API", "STATUS"]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("newerminor "))
    assert f" {MAJOR}.7 " in line and "loadable" in line
    assert "upgrade hermes-env-core" in proc.stdout
    assert f"plugin API of this core: {API_VERSION}" in proc.stdout


def test_doctor_fails_naming_the_refused_plugin(site):
    proc = cli(site, "doctor", "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["api_version"] == API_VERSION and not out["ok"]
    errors = " ".join(f["error"] for f in out["failed_plugins"])
    assert "hermes-env-future 3.1" in errors and "hermes-env-ancient 0.2" in errors
    text = cli(site, "doctor")
    assert text.returncode == 1
    assert "plugin future (hermes-env-future 3.1): FAIL: hermes-env-future 3.1 is built for" in text.stdout


def test_asking_for_a_refused_backend_is_an_error_with_the_fix(site):
    proc = cli(site, "run", "--env", "future", "echo hi")
    assert proc.returncode != 0
    assert "upgrade hermes-env-core" in proc.stderr and "hi" not in proc.stdout
    ok = cli(site, "run", "--env", "newerminor", "echo hi")
    assert ok.returncode == 0 and ok.stdout == "hi\n", ok.stderr


def test_spec_defaults_to_this_api_and_rejects_bad_versions():
    spec = BackendSpec(name="x", target="a.b:C")
    assert spec.api_version == API_VERSION
    for bad in ("2", "2.0.1", "", "x.y"):
        with pytest.raises(ValueError, match="MAJOR.MINOR"):
            BackendSpec(name="x", target="a.b:C", api_version=bad)
    with pytest.raises(ValueError, match="must be a string"):
        BackendSpec(name="x", target="a.b:C", api_version=1.0)  # type: ignore[arg-type]
