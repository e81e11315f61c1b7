"""Install hints name what works: a path in a checkout for this project's unpublished distributions, never
``pip install <a name the package index does not have>``; and no placeholder links in any pyproject."""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from hermes_env_core.plugins import builtin
from hermes_env_core.plugins.registry import KNOWN_BACKENDS
from hermes_env_core.plugins.spec import UNPUBLISHED, BackendSpec, api_refusal

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_MODULES = sorted(
    [*ROOT.glob("plugins/hermes-env-*/hermes_env_*/plugin.py"), *ROOT.glob("examples/hermes-env-*/hermes_env_*/plugin.py")]
)
PYPROJECTS = sorted(p for p in ROOT.glob("**/pyproject.toml") if ".venv" not in p.parts and "__DIST__" not in str(p))


def bare_unpublished(hint: str) -> list[str]:
    """Requirements in the ``pip install`` commands of ``hint`` that name an unpublished distribution by name.

    ``hermes-env-core[extra]`` is allowed: the core is installed wherever a hint is shown, and pip then only
    adds the extra's requirements.
    """
    bad = []
    for command in re.findall(r"pip install ([^;()]*)", hint):
        for word in shlex.split(command):
            if word.startswith("-"):
                continue
            if not re.match(r"[A-Za-z0-9]", word) or word in ("in", "a", "hermes-env", "checkout"):
                if word.startswith((".", "/")):
                    continue
                break  # the end of the requirements
            name = re.match(r"[A-Za-z0-9._-]+", word).group(0).lower()  # type: ignore[union-attr]
            if name in UNPUBLISHED and not (name == "hermes-env-core" and "[" in word):
                bad.append(word)
    return bad


def test_the_checker_catches_what_the_issue_saw():
    assert bare_unpublished("pip install hermes-env-singularity") == ["hermes-env-singularity"]
    assert bare_unpublished("pip install -U hermes-env-core") == ["hermes-env-core"]
    assert bare_unpublished("pip install 'hermes-env-modal>=0.1'") == ["hermes-env-modal>=0.1"]
    assert bare_unpublished("pip install ./plugins/hermes-env-modal in a hermes-env checkout") == []
    assert bare_unpublished("pip install 'hermes-env-core[docker]'") == []


def _plugin_specs() -> list[BackendSpec]:
    specs: list[BackendSpec] = []
    for path in PLUGIN_MODULES:
        spec = importlib.util.spec_from_file_location(f"_hint_check_{path.parent.name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # plugin.py imports nothing but the core's spec record
        specs += [s for s in module.hermes_env_backends()]
    return specs


def test_every_plugin_in_the_repository_is_checked():
    names = {s.name for s in _plugin_specs()}
    assert {"modal", "daytona", "singularity", "example", "kubernetes"} <= names


@pytest.mark.parametrize("spec", [*builtin.hermes_env_backends(), *_plugin_specs()], ids=lambda s: s.name)
def test_a_spec_hint_names_no_unpublished_distribution(spec):
    assert spec.install_hint or spec.name == "local", f"backend {spec.name!r} has no install hint"
    assert bare_unpublished(spec.install_hint or "") == [], spec.install_hint


@pytest.mark.parametrize("name", sorted(KNOWN_BACKENDS))
def test_a_known_backend_hint_is_its_path_in_a_checkout(name):
    known = KNOWN_BACKENDS[name]
    hint = known.install_hint
    assert bare_unpublished(hint) == [], hint
    path = UNPUBLISHED[known.distribution]
    assert f"pip install ./{path} " in hint and (ROOT / path / "pyproject.toml").is_file()


@pytest.mark.parametrize("distribution", ["hermes-env-modal", "hermes-env-core"])
def test_the_api_version_refusal_says_how_to_upgrade_from_a_checkout(distribution):
    for version in ("0.1", "99.0"):
        spec = BackendSpec(name="x", target="m:C", api_version=version, distribution=distribution)
        message = api_refusal(spec, plugin=distribution, core="hermes-env-core 0.1.0")
        assert message is not None and "pip install -U" in message
        assert bare_unpublished(message) == [], message


def test_every_unpublished_path_is_a_distribution_of_that_name():
    for dist, path in UNPUBLISHED.items():
        data = tomllib.loads((ROOT / path / "pyproject.toml").read_text())
        assert data["project"]["name"] == dist


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pyproject_has_placeholder_urls(pyproject):
    data = tomllib.loads(pyproject.read_text())
    assert "urls" not in data.get("project", {}), f"{pyproject}: [project.urls] points nowhere yet; leave it out"
