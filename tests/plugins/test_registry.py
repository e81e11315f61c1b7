"""The backend registry in process: lookup errors, programmatic registration, lazy loading."""

from __future__ import annotations

import sys
import textwrap

import pytest
from pydantic import BaseModel

from hermes_env_core import (
    BackendNotFoundError,
    BackendNotInstalledError,
    BackendRegistry,
    BackendSpec,
    DuplicateBackendError,
    EnvironmentConfig,
    PluginLoadError,
    hookimpl,
)
from hermes_env_core.backends.local import LocalConfig, LocalEnvironment
from hermes_env_core.plugins import builtin


def core_only() -> BackendRegistry:
    registry = BackendRegistry(entry_points=False)
    registry.register(builtin, name="core", distribution="hermes-env-core")
    return registry


class Provides:
    """A plugin object providing the given specs."""

    def __init__(self, *specs: BackendSpec) -> None:
        self.specs = specs

    @hookimpl
    def hermes_env_backends(self):
        return list(self.specs)


def test_builtins_are_registered_through_the_hook():
    registry = core_only()
    assert registry.names() == ["docker", "local", "ssh"]
    assert registry.backends["docker"].install_hint == "pip install 'hermes-env-core[docker]'"
    assert registry.backends["ssh"].install_hint == "pip install 'hermes-env-core[ssh]'"
    assert {s.distribution for s in registry.backends.values()} == {"hermes-env-core"}
    assert registry.load("local") is LocalEnvironment
    assert registry.config_model("local") is LocalConfig


def test_the_public_view_is_read_only():
    registry = core_only()
    with pytest.raises(TypeError):
        registry.backends["evil"] = registry.backends["local"]  # type: ignore[index]
    with pytest.raises(TypeError):
        registry.aliases["x"] = "local"  # type: ignore[index]
    with pytest.raises(AttributeError):
        registry.backends["local"].name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "typo, suggestion",
    [("dokcer", "'docker'"), ("locl", "'local'"), ("shh", "'ssh'"), ("modl", "'modal' (pip install ./plugins/hermes-env-modal in a hermes-env checkout; hermes-env-modal is not on PyPI yet)")],
)
def test_a_typo_gets_a_close_match_and_the_installed_names(typo, suggestion):
    with pytest.raises(BackendNotFoundError) as info:
        core_only().resolve(typo)
    message = str(info.value)
    assert f"unknown backend {typo!r}" in message
    assert f"did you mean {suggestion}?" in message
    assert "Installed backends: docker, local, ssh." in message
    assert not isinstance(info.value, BackendNotInstalledError)


def test_a_name_far_from_everything_gets_no_suggestion():
    with pytest.raises(BackendNotFoundError) as info:
        core_only().resolve("kubernetes")
    assert "did you mean" not in str(info.value)
    assert "Installed backends: docker, local, ssh." in str(info.value)
    assert "may not be installed" in str(info.value)


@pytest.mark.parametrize(
    "name, dist",
    [
        ("modal", "hermes-env-modal"),
        ("daytona", "hermes-env-daytona"),
        ("singularity", "hermes-env-singularity"),
        ("apptainer", "hermes-env-singularity"),
    ],
)
def test_a_known_backend_that_is_not_installed_gives_the_pip_line(name, dist):
    with pytest.raises(BackendNotInstalledError) as info:
        core_only().resolve(name)
    message = str(info.value)
    assert message.endswith(f"which is not installed: pip install ./plugins/{dist} in a hermes-env checkout; {dist} is not on PyPI yet")
    assert f"backend {name!r}" in message
    if name == "apptainer":
        assert "alias of 'singularity'" in message


def test_names_are_case_insensitive_and_aliases_resolve():
    registry = core_only()
    registry.register(Provides(BackendSpec(name="thing", target="m:C", aliases=("t", "th"))), distribution="d")
    assert registry.resolve("THING").name == "thing"
    assert registry.resolve("th").name == "thing"
    assert registry.aliases == {"t": "thing", "th": "thing"}
    assert "t" in registry and "nope" not in registry
    assert registry.provider("t").distribution == "d"


def test_registering_a_taken_name_raises_naming_both_and_changes_nothing():
    registry = core_only()
    registry.register(Provides(BackendSpec(name="one", target="m:C")), distribution="dist-a")
    before = dict(registry.backends)
    with pytest.raises(DuplicateBackendError) as info:
        registry.register(
            Provides(BackendSpec(name="two", target="m:C"), BackendSpec(name="three", target="m:C", aliases=("one",))),
            distribution="dist-b",
        )
    assert "'one'" in str(info.value) and "dist-a" in str(info.value) and "dist-b" in str(info.value)
    assert dict(registry.backends) == before
    # and the rejected plugin is not left behind in pluggy either
    registry.register(Provides(BackendSpec(name="two", target="m:C")), distribution="dist-c")
    assert registry.backends["two"].distribution == "dist-c"


def test_one_plugin_listing_a_name_twice_is_a_duplicate():
    with pytest.raises(DuplicateBackendError, match="'same'"):
        core_only().register(
            Provides(BackendSpec(name="same", target="m:C"), BackendSpec(name="same", target="m:D")), distribution="x"
        )


def test_a_failing_hook_raises_on_programmatic_registration():
    class Broken:
        @hookimpl
        def hermes_env_backends(self):
            raise ValueError("nope")

    with pytest.raises(PluginLoadError, match="ValueError: nope"):
        core_only().register(Broken(), name="broken")


def test_a_hook_may_return_a_generator_or_none():
    class Gen:
        @hookimpl
        def hermes_env_backends(self):
            yield BackendSpec(name="gen", target="m:C")

    class Nothing:
        @hookimpl
        def hermes_env_backends(self):
            return None

    registry = core_only()
    registry.register(Gen(), distribution="g")
    info = registry.register(Nothing(), distribution="n")
    assert "gen" in registry.backends and info.backends == ()


@pytest.fixture
def backend_module(tmp_path, monkeypatch):
    """A throwaway backend module on sys.path; returns its name."""
    name = "hermes_env_lazy_probe"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent("""
        from hermes_env_core.backends.local import LocalConfig, LocalEnvironment

        IMPORTS = 1

        class ProbeConfig(LocalConfig):
            colour: str = "blue"

        class ProbeEnvironment(LocalEnvironment):
            name = "probe"
            config_model = ProbeConfig

        NOT_A_BACKEND = object()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_the_target_is_imported_on_first_load_and_cached(backend_module):
    registry = core_only()
    registry.register(
        Provides(
            BackendSpec(
                name="probe", target=f"{backend_module}:ProbeEnvironment", config_model=f"{backend_module}:ProbeConfig"
            )
        ),
        distribution="probe-dist",
    )
    registry.names(), registry.backends["probe"], registry.resolve("probe")
    assert backend_module not in sys.modules and not registry.is_loaded("probe")
    cls = registry.load("probe")
    assert backend_module in sys.modules and registry.is_loaded("probe")
    assert cls.__name__ == "ProbeEnvironment"
    sys.modules.pop(backend_module)  # a second import would be a new class object
    assert registry.load("probe") is cls
    assert registry.config_model("probe") is registry.config_model("probe")


def test_the_config_model_defaults_to_the_class_attribute(backend_module):
    registry = core_only()
    registry.register(
        Provides(BackendSpec(name="probe", target=f"{backend_module}:ProbeEnvironment")), distribution="p"
    )
    assert registry.config_model("probe").__name__ == "ProbeConfig"


def test_a_config_model_class_is_used_as_is():
    class Opts(EnvironmentConfig):
        extra_knob: int = 3

    registry = core_only()
    registry.register(
        Provides(BackendSpec(name="cls", target="hermes_env_core.backends.local:LocalEnvironment", config_model=Opts)),
        distribution="p",
    )
    assert registry.config_model("cls") is Opts


def test_a_target_that_is_not_a_backend_class_is_a_plugin_load_error(backend_module):
    registry = core_only()
    registry.register(
        Provides(
            BackendSpec(name="odd", target=f"{backend_module}:NOT_A_BACKEND"),
            BackendSpec(name="gone", target=f"{backend_module}:Missing"),
            BackendSpec(name="nomod", target="hermes_env_no_such_module_x:C"),
        ),
        distribution="p",
    )
    with pytest.raises(PluginLoadError, match="not a BaseEnvironment subclass"):
        registry.load("odd")
    with pytest.raises(PluginLoadError, match="has no backend class 'Missing'"):
        registry.load("gone")
    with pytest.raises(PluginLoadError, match="is missing; reinstall p"):
        registry.load("nomod")


def test_a_missing_dependency_names_it_and_the_install_hint(tmp_path, monkeypatch):
    (tmp_path / "hermes_env_needs_sdk.py").write_text("import some_sdk_that_is_not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = core_only()
    registry.register(
        Provides(BackendSpec(name="needy", target="hermes_env_needs_sdk:C", install_hint="pip install needy-extra")),
        distribution="needy-dist",
    )
    with pytest.raises(PluginLoadError) as info:
        registry.load("needy")
    message = str(info.value)
    assert "some_sdk_that_is_not_installed_xyz" in message and "pip install needy-extra" in message
    assert "needy-dist" in message


def test_a_config_model_that_is_not_pydantic_is_rejected():
    class NotAModel:
        pass

    registry = core_only()
    registry.register(
        Provides(
            BackendSpec(name="bad", target="hermes_env_core.backends.local:LocalEnvironment", config_model=NotAModel)
        ),
        distribution="p",
    )
    with pytest.raises(PluginLoadError, match="not a pydantic model"):
        registry.config_model("bad")
    assert issubclass(registry.config_model("local"), BaseModel)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"name": "Bad Name", "target": "m:C"}, "must match"),
        ({"name": "ok", "target": "no-colon"}, "package.module:Attribute"),
        ({"name": "ok", "target": "m:C", "aliases": ("ok",)}, "its own name"),
        ({"name": "ok", "target": "m:C", "aliases": ("UPPER",)}, "must match"),
        ({"name": "ok", "target": "m:C", "config_model": "not a target"}, "package.module:Attribute"),
        ({"name": "ok", "target": "m:C", "config_model": 42}, "config_model"),
    ],
)
def test_backend_spec_validates_its_fields(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        BackendSpec(**kwargs)


def test_backend_spec_is_frozen_and_takes_one_alias_as_a_string():
    spec = BackendSpec(name="x", target="m:C", aliases="y")  # type: ignore[arg-type]
    assert spec.aliases == ("y",) and spec.names == ("x", "y") and spec.module == "m"
    with pytest.raises(AttributeError):
        spec.name = "z"  # type: ignore[misc]
