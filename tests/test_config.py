"""Configuration: precedence, parsing of TERMINAL_* values and the TOML file, and errors that name the source."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field

from hermes_env_core import (
    BackendNotFoundError,
    BackendRegistry,
    BackendSpec,
    ConfigError,
    EnvironmentConfig,
    hookimpl,
    MemorySize,
    load_config_file,
    memory_bytes,
    resolve_config,
)
from hermes_env_core.plugins import builtin


class RichConfig(EnvironmentConfig):
    host: str
    port: int = 22
    ratio: float = 0.5
    verbose: bool = False
    tags: tuple[str, ...] = ()
    labels: dict[str, str] = Field(default_factory=dict)
    note: str | None = None


class _Plugin:
    @hookimpl
    def hermes_env_backends(self):
        return [
            BackendSpec(
                name="rich",
                target="hermes_env_core.backends.local:LocalEnvironment",
                aliases=("r",),
                config_model=RichConfig,
            ),
        ]


REGISTRY = BackendRegistry(entry_points=False)
REGISTRY.register(builtin, name="core", distribution="hermes-env-core")
REGISTRY.register(_Plugin(), name="rich", distribution="rich-dist")


def resolve(name=None, options=None, *, environ=None, file=None, **kw):
    return resolve_config(name, options, registry=REGISTRY, environ=environ or {}, config_file=file, **kw)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(("TERMINAL_", "HERMES_ENV_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def toml(tmp_path):
    def write(text: str, name: str = "conf.toml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


# -- TOML writing for property tests -------------------------------------------------


def toml_str(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return toml_str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_str(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


env_text = st.text(st.characters(blacklist_characters="\x00"), max_size=40)


# -- which backend ------------------------------------------------------------------------


def test_the_default_backend_is_local():
    resolved = resolve()
    assert (resolved.backend, resolved.backend_source) == ("local", "default")
    assert resolved.config_file is None


@settings(max_examples=40, deadline=None)
@given(
    arg=st.sampled_from([None, "local", "rich"]),
    env=st.sampled_from([None, "local", "r"]),
    file=st.sampled_from([None, "local", "rich"]),
)
def test_the_backend_comes_from_argument_then_terminal_env_then_file(tmp_path_factory, arg, env, file):
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    selector = f'[terminal]\nenv = "{file}"\n' if file else ""
    path.write_text(selector + '[terminal.rich]\nhost = "h"\n')
    environ = {"TERMINAL_ENV": env} if env else {}
    resolved = resolve(arg, environ=environ, file=str(path))
    expected = arg or env or file or "local"
    assert resolved.backend == {"r": "rich"}.get(expected, expected)
    if arg:
        assert resolved.backend_source == "argument"
    elif env:
        assert resolved.backend_source == "environment variable TERMINAL_ENV"
    elif file:
        assert resolved.backend_source == f"{path} [terminal] env"
    else:
        assert resolved.backend_source == "default"


def test_an_unknown_backend_from_terminal_env_says_where_it_came_from():
    with pytest.raises(BackendNotFoundError) as info:
        resolve(environ={"TERMINAL_ENV": "dokcer"})
    assert "did you mean 'docker'?" in str(info.value) and "TERMINAL_ENV" in str(info.value)


# -- precedence of values ------------------------------------------------------------------

LAYERS = ("file_common", "file_table", "env", "argument")


@settings(max_examples=60, deadline=None)
@given(
    present=st.lists(st.sampled_from(LAYERS), unique=True),
    ports=st.lists(st.integers(1, 65535), min_size=4, max_size=4, unique=True),
)
def test_each_value_comes_from_the_highest_source_that_sets_it(tmp_path_factory, present, ports):
    value = dict(zip(LAYERS, ports, strict=True))
    common = f"port = {value['file_common']}\n" if "file_common" in present else ""
    table = f"port = {value['file_table']}\n" if "file_table" in present else ""
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_text(f'[terminal]\nenv = "rich"\n{common}[terminal.rich]\nhost = "h"\n{table}')
    environ = {"TERMINAL_PORT": str(value["env"])} if "env" in present else {}
    options = {"port": value["argument"]} if "argument" in present else {}
    resolved = resolve(None, options, environ=environ, file=str(path))
    winner = next((layer for layer in reversed(LAYERS) if layer in present), None)
    expected_source = {
        "file_common": f"{path} [terminal]",
        "file_table": f"{path} [terminal.rich]",
        "env": "environment variable TERMINAL_PORT",
        "argument": "argument",
        None: "default",
    }[winner]
    assert resolved.values["port"].value == (value[winner] if winner else 22)
    assert resolved.values["port"].source == expected_source
    assert resolved.config.port == resolved.values["port"].value  # type: ignore[attr-defined]


def test_option_strings_rank_with_arguments_and_python_values_win():
    resolved = resolve(
        "rich",
        {"port": 3},
        option_strings={"host": "a", "port": "2"},
        environ={"TERMINAL_HOST": "b", "TERMINAL_PORT": "1"},
    )
    assert resolved.values["host"].value == "a" and resolved.values["host"].source == "--option host"
    assert resolved.values["port"].value == 3 and resolved.values["port"].source == "argument"


def test_every_field_has_a_value_and_a_source_and_the_view_is_read_only():
    resolved = resolve("rich", {"host": "h"})
    assert set(resolved.values) == set(RichConfig.model_fields)
    assert resolved.values["ratio"].source == "default" and resolved.values["host"].source == "argument"
    with pytest.raises(TypeError):
        resolved.values["host"] = None  # type: ignore[index]


# -- parsing TERMINAL_* values -------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    port=st.integers(-(2**63), 2**63 - 1),
    ratio=st.floats(allow_nan=False, allow_infinity=False),
    host=env_text.filter(bool),
    tags=st.lists(env_text, max_size=5),
    labels=st.dictionaries(env_text, env_text, max_size=5),
)
def test_terminal_variables_are_parsed_by_the_model(port, ratio, host, tags, labels):
    environ = {
        "TERMINAL_ENV": "rich",
        "TERMINAL_HOST": host,
        "TERMINAL_PORT": str(port),
        "TERMINAL_RATIO": repr(ratio),
        "TERMINAL_TAGS": json.dumps(tags),
        "TERMINAL_LABELS": json.dumps(labels),
    }
    config = resolve(environ=environ).config
    assert config.host == host  # text stays text, even when it looks like JSON or a number
    assert config.port == port
    assert config.ratio == ratio or (math.isclose(config.ratio, ratio))
    assert config.tags == tuple(tags)
    assert config.labels == labels


@pytest.mark.parametrize(
    "text, value", [("true", True), ("false", False), ("1", True), ("0", False), ("yes", True), ("off", False)]
)
def test_terminal_booleans(text, value):
    assert (
        resolve(environ={"TERMINAL_ENV": "rich", "TERMINAL_HOST": "h", "TERMINAL_VERBOSE": text}).config.verbose
        is value
    )


@given(note=env_text)
def test_null_sets_an_optional_field_to_none_and_other_text_is_kept(note):
    config = resolve("rich", environ={"TERMINAL_HOST": "h", "TERMINAL_NOTE": note}).config
    assert config.note == (None if note == "null" else note)
    # a field that may not be None keeps the text "null"
    assert resolve("rich", environ={"TERMINAL_HOST": "null"}).config.host == "null"


def test_a_list_option_that_is_not_json_names_the_variable():
    with pytest.raises(ConfigError) as info:
        resolve(environ={"TERMINAL_ENV_PASSTHROUGH": "MY_*"})
    assert "TERMINAL_ENV_PASSTHROUGH" in str(info.value) and "JSON" in str(info.value)


def test_an_invalid_value_names_the_option_backend_and_variable():
    with pytest.raises(ConfigError) as info:
        resolve(environ={"TERMINAL_TIMEOUT": "soon"})
    message = str(info.value)
    assert "timeout" in message and "'local'" in message and "environment variable TERMINAL_TIMEOUT" in message
    assert "'soon'" in message
    with pytest.raises(ConfigError, match="from environment variable TERMINAL_TIMEOUT"):
        resolve(environ={"TERMINAL_TIMEOUT": "-1"})


def test_an_unknown_terminal_variable_is_ignored_and_reported_with_a_suggestion():
    resolved = resolve(environ={"TERMINAL_TIMOUT": "3"})
    assert resolved.backend == "local" and resolved.values["timeout"].source == "default"
    [ignored] = resolved.ignored
    assert (ignored.key, ignored.source) == ("timout", "environment variable TERMINAL_TIMOUT")
    assert ignored.reason == "not an option of backend 'local'; did you mean 'timeout'?"


def test_variables_other_programs_set_are_not_options():
    resolved = resolve(environ={"TERMINAL_EMULATOR": "JetBrains-JediTerm"})
    assert resolved.backend == "local" and resolved.ignored == ()


@settings(max_examples=40, deadline=None)
@given(
    names=st.lists(
        st.text(st.characters(whitelist_categories=("Lu", "Nd"), whitelist_characters="_"), min_size=1, max_size=12),
        max_size=5,
    ),
    value=env_text,
)
def test_any_terminal_variable_that_is_not_an_option_is_ignored_never_an_error(names, value):
    fields = set(EnvironmentConfig.model_fields) | {"env"}
    environ = {f"TERMINAL_{n}": value for n in names if n.lower() not in fields}
    resolved = resolve(environ=environ)
    assert resolved.backend == "local"
    assert {i.source for i in resolved.ignored} == {f"environment variable {v}" for v in environ}
    assert all(i.reason.startswith("not an option of backend 'local'") for i in resolved.ignored)


def test_an_option_of_another_backend_is_ignored_here_and_applies_there():
    environ = {"TERMINAL_PORT": "2222", "TERMINAL_IMAGE": "python:3.12"}
    resolved = resolve(environ=environ)
    assert {i.key for i in resolved.ignored} == {"port", "image"}
    rich = resolve("rich", {"host": "h"}, environ=environ)
    assert rich.config.port == 2222 and [i.key for i in rich.ignored] == ["image"]


def test_a_shared_terminal_key_that_is_not_an_option_is_ignored_but_the_backend_table_is_strict(toml):
    path = toml('[terminal]\ntimeout = 5\nimage = "python:3.12"\n[terminal.local]\ncolour = "blue"\n')
    with pytest.raises(ConfigError, match=r"unknown option 'colour' for backend 'local' \(from .*\[terminal.local\]\)"):
        resolve(file=path)
    path = toml('[terminal]\ntimeout = 5\nimage = "python:3.12"\n')
    resolved = resolve(file=path)
    assert resolved.config.timeout == 5
    [ignored] = resolved.ignored
    assert (ignored.key, ignored.source) == ("image", f"{path} [terminal]")


def test_an_unknown_argument_is_rejected_by_name():
    with pytest.raises(ConfigError) as info:
        resolve("local", {"colour": "blue"})
    assert "unknown option 'colour' for backend 'local' (from argument)" in str(info.value)


# -- the TOML file ------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    host=st.text(max_size=40),
    port=st.integers(-(2**63), 2**63 - 1),
    ratio=st.floats(allow_nan=False, allow_infinity=False),
    verbose=st.booleans(),
    tags=st.lists(st.text(max_size=10), max_size=5),
    labels=st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=5),
    env=st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3),
)
def test_toml_values_reach_the_model(tmp_path_factory, host, port, ratio, verbose, tags, labels, env):
    body = "\n".join(
        f"{k} = {toml_value(v)}"
        for k, v in dict(host=host, port=port, ratio=ratio, tags=tags, labels=labels, env=env).items()
    )
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_text(
        f'[terminal]\nenv = "rich"\nverbose = {toml_value(verbose)}\n\n[terminal.rich]\n{body}\n', encoding="utf-8"
    )
    resolved = resolve(file=str(path))
    config = resolved.config
    assert (config.host, config.port, config.verbose) == (host, port, verbose)
    assert config.ratio == ratio
    assert config.tags == tuple(tags) and config.labels == labels and config.env == env
    assert resolved.values["verbose"].source == f"{path} [terminal]"
    assert resolved.values["env"].source == f"{path} [terminal.rich]"


def test_the_file_is_found_by_env_var_else_in_the_working_directory(tmp_path, toml):
    Path("hermes-env.toml").write_text("[terminal]\ntimeout = 11\n")
    assert resolve().config.timeout == 11
    assert resolve().values["timeout"].source == f"{tmp_path / 'hermes-env.toml'} [terminal]"
    other = toml("[terminal]\ntimeout = 12\n")
    assert resolve(environ={"HERMES_ENV_CONFIG": other}).config.timeout == 12
    assert resolve(environ={"HERMES_ENV_CONFIG": other}, file=toml("", "empty.toml")).config.timeout == 180


def test_a_named_config_file_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="HERMES_ENV_CONFIG"):
        resolve(environ={"HERMES_ENV_CONFIG": str(tmp_path / "nope.toml")})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "nope.toml")


def test_invalid_toml_names_the_file(toml):
    path = toml("[terminal\n")
    with pytest.raises(ConfigError) as info:
        resolve(file=path)
    assert path in str(info.value) and "not valid TOML" in str(info.value)


def test_unknown_keys_in_the_backend_table_name_the_key_the_table_and_the_file(toml):
    path = toml('[terminal]\nenv = "rich"\n[terminal.rich]\nhost = "h"\nprot = 1\n')
    with pytest.raises(ConfigError) as info:
        resolve(file=path)
    assert f"unknown option 'prot' for backend 'rich' (from {path} [terminal.rich]); did you mean 'port'?" in str(
        info.value
    )
    resolved = resolve(file=toml("[terminal]\ntimeot = 3\n"))
    assert [(i.key, i.reason) for i in resolved.ignored] == [
        ("timeot", "not an option of backend 'local'; did you mean 'timeout'?")
    ]


def test_a_misspelt_backend_table_is_rejected_with_a_suggestion(toml):
    path = toml('[terminal.dokcer]\nimage = "x"\n')
    with pytest.raises(ConfigError) as info:
        resolve(file=path)
    assert "[terminal.dokcer]" in str(info.value) and "did you mean [terminal.docker]?" in str(info.value)


def test_only_the_terminal_table_is_read(toml):
    with pytest.raises(ConfigError, match=r"unknown key 'termnal'.*only the \[terminal\] table"):
        resolve(file=toml("[termnal]\nenv = 'local'\n"))
    with pytest.raises(ConfigError, match="must be a backend name"):
        resolve(file=toml("[terminal]\nenv = 3\n"))


def test_tables_of_other_backends_are_ignored(toml):
    path = toml(
        '[terminal]\ntimeout = 5\n[terminal.docker]\nimage = "python:3.11"\n'
        '[terminal.modal]\nanything = 1\n[terminal.rich]\nhost = "h"\n'
    )
    resolved = resolve(file=path)
    assert resolved.backend == "local" and resolved.config.timeout == 5


def test_an_alias_table_applies_and_the_name_table_wins(toml):
    path = toml('[terminal]\nenv = "r"\n[terminal.r]\nhost = "from-alias"\nport = 1\n[terminal.rich]\nport = 2\n')
    resolved = resolve(file=path)
    assert resolved.config.host == "from-alias" and resolved.config.port == 2
    assert resolved.values["host"].source == f"{path} [terminal.r]"


def test_a_missing_required_option_names_it_and_the_backend():
    with pytest.raises(ConfigError) as info:
        resolve("rich")
    message = str(info.value)
    assert "backend 'rich' needs option 'host'" in message
    assert "TERMINAL_HOST" in message and "[terminal.rich]" in message


def test_an_invalid_file_value_names_the_file(toml):
    path = toml('[terminal]\nenv = "rich"\n[terminal.rich]\nhost = "h"\nport = "many"\n')
    with pytest.raises(ConfigError, match=f"port for backend 'rich' from {path} \\[terminal.rich\\]"):
        resolve(file=path)


# -- option names and units shared by backends ----------------------------------------------


@pytest.mark.parametrize(
    "text, canonical, size",
    [("2g", "2g", 2 << 30), ("512m", "512m", 512 << 20), ("2G", "2g", 2 << 30), ("1.5GiB", "1.5g", 3 << 29),
     (" 64 MB ", "64m", 64 << 20), ("4096k", "4096k", 4 << 20), ("100b", "100b", 100), ("1.50t", "1.5t", 3 << 39)],
)
def test_memory_sizes_are_read_in_one_spelling(text, canonical, size):
    config = MemoryProbe(memory=text)
    assert config.memory == canonical and memory_bytes(config.memory) == size


@pytest.mark.parametrize("bad", [2048, "2048", "lots", "2 gigs", "-1g", "0m", True])
def test_a_memory_size_without_a_unit_is_an_error_naming_the_value(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        MemoryProbe(memory=bad)
    assert repr(bad) in str(info.value) and "memory" in str(info.value)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10**6), st.sampled_from("kmgKMG"))
def test_memory_sizes_round_trip(number, unit):
    config = MemoryProbe(memory=f"{number}{unit}")
    assert memory_bytes(config.memory) == number * {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit.lower()]


def test_core_backends_share_option_names_and_units():
    from hermes_env_core.backends.docker import DockerConfig
    from hermes_env_core.backends.ssh import SSHConfig

    assert "cpu" in DockerConfig.model_fields and "cpus" not in DockerConfig.model_fields
    assert DockerConfig.model_fields["memory"].metadata == MemoryProbe.model_fields["memory"].metadata
    assert {"sync_interval_s", "pull_on_close"} <= set(SSHConfig.model_fields)
    from hermes_env_core.backends.ssh import SSHEnvironment

    assert hasattr(SSHEnvironment, "pull_files") and not hasattr(SSHEnvironment, "pull_back")


class MemoryProbe(EnvironmentConfig):
    memory: MemorySize | None = None
