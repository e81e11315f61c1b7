"""Which backend to use and with what options, from arguments, environment and a TOML file.

Precedence, highest first: explicit arguments > environment variables
(``TERMINAL_ENV``, ``TERMINAL_<FIELD>``) > the ``[terminal]`` table of the
config file (``HERMES_ENV_CONFIG``, else ``./hermes-env.toml``) > the backend
config model's defaults. Every value keeps the name of where it came from.

The file::

    [terminal]
    env = "docker"          # the backend, when neither an argument nor TERMINAL_ENV names one
    timeout = 60            # any option of the selected backend

    [terminal.docker]       # options for one backend (name or alias); used only when it is selected
    image = "python:3.11"

Environment variables: ``TERMINAL_<FIELD>`` sets ``<field>`` of the selected
backend (``TERMINAL_TIMEOUT=30``); lists, tuples, dicts and models are JSON
(``TERMINAL_ENV_PASSTHROUGH='["MY_*"]'``); ``null`` sets a field that allows it
to None. In ``[terminal]`` and as ``TERMINAL_ENV``, ``env`` means the backend;
the ``env`` option (variables for commands) is set in ``[terminal.<backend>]``
or as an argument.

Strictness follows who wrote the value. An unknown key passed as an argument
or written in the selected backend's own table (``[terminal.<backend>]``) is an
error naming the key and its source. A ``TERMINAL_*`` variable or a key of the
shared ``[terminal]`` table that is not an option of the selected backend is
ignored: the environment and a shared file serve every backend (``TERMINAL_IMAGE``
means nothing to ``local``). ``ResolvedConfig.ignored`` lists each one with the
reason, and ``hermes-env config`` shows them.

Options that several backends have share one name and unit: ``cpu`` (cores),
``memory`` (a size string such as ``"2g"`` or ``"512m"``, see ``MemorySize``),
``start_timeout`` (seconds), ``sync_interval_s``, ``pull_on_close``.
"""

from __future__ import annotations

import collections.abc
import difflib
import json
import os
import re
import sys
import tomllib
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, BeforeValidator, ValidationError

from .errors import BackendNotFoundError, ConfigError

if TYPE_CHECKING:
    from .plugins.registry import BackendRegistry

__all__ = [
    "BACKEND_ENV_VAR",
    "CONFIG_ENV_VAR",
    "DEFAULT_BACKEND",
    "DEFAULT_CONFIG_FILE",
    "FIELD_ENV_PREFIX",
    "ConfigFile",
    "ConfigValue",
    "ConfigWarning",
    "IgnoredSetting",
    "MemorySize",
    "ResolvedConfig",
    "memory_bytes",
    "load_config_file",
    "parse_option_string",
    "resolve_backend_name",
    "resolve_config",
]

BACKEND_ENV_VAR = "TERMINAL_ENV"
FIELD_ENV_PREFIX = "TERMINAL_"
CONFIG_ENV_VAR = "HERMES_ENV_CONFIG"
DEFAULT_CONFIG_FILE = "hermes-env.toml"
DEFAULT_BACKEND = "local"
TABLE = "terminal"

#: TERMINAL_* variables other programs set (IDE terminals); never read as options.
FOREIGN_ENV_VARS = frozenset({"TERMINAL_EMULATOR"})

SOURCE_ARGUMENT = "argument"
SOURCE_DEFAULT = "default"


class ConfigWarning(UserWarning):
    """A setting that looks misspelt (``TERMINAL_TIMOUT``, ``timout`` in ``[terminal]``): ignored, and said so."""


@dataclass(frozen=True)
class ConfigFile:
    """The ``[terminal]`` table of a config file, as read."""

    path: str
    terminal: Mapping[str, Any] = field(default_factory=dict)

    @property
    def backend(self) -> str | None:
        value = self.terminal.get("env")
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ConfigValue:
    value: Any
    source: str


@dataclass(frozen=True)
class IgnoredSetting:
    """A value that was set but does not apply to the selected backend, and why.

    ``misspelt``: no installed backend has that option, so it is most likely
    a typo (``suggestion``, when set, is the close option name).
    """

    key: str
    source: str
    reason: str
    misspelt: bool = False
    suggestion: str | None = None

    def warning(self) -> str:
        """One line saying what is ignored and what was probably meant."""
        is_var = self.source.startswith("environment variable ")
        shown = self.source.removeprefix("environment variable ") if is_var else f"{self.key!r} in {self.source}"
        text = f"{shown} is ignored: no backend has an option {self.key!r}"
        if self.suggestion is not None:
            meant = f"{FIELD_ENV_PREFIX}{self.suggestion.upper()}" if is_var else repr(self.suggestion)
            text += f"; did you mean {meant}?"
        return text


@dataclass(frozen=True)
class ResolvedConfig:
    """The outcome of resolution: the backend, its validated options, and where each came from."""

    backend: str
    backend_source: str
    config: BaseModel
    values: Mapping[str, ConfigValue]
    config_file: str | None = None
    ignored: tuple[IgnoredSetting, ...] = ()

    def source_of(self, name: str) -> str:
        return self.values[name].source


def load_config_file(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> ConfigFile | None:
    """Read the config file: ``path``, else ``$HERMES_ENV_CONFIG``, else ``./hermes-env.toml`` if present."""
    env = os.environ if environ is None else environ
    if path is not None:
        where, required = Path(path), True
    elif env.get(CONFIG_ENV_VAR):
        where, required = Path(env[CONFIG_ENV_VAR]), True
    else:
        where, required = Path(cwd or os.getcwd()) / DEFAULT_CONFIG_FILE, False
    where = where.expanduser()
    try:
        with open(where, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        if not required:
            return None
        named = f" (named by {CONFIG_ENV_VAR})" if path is None else ""
        raise ConfigError(f"config file {where}{named} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {where} is not valid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"config file {where} cannot be read: {exc}") from exc
    shown = str(where)
    for key in data:
        if key != TABLE:
            raise ConfigError(f"unknown key {key!r} in {shown}: hermes-env reads only the [{TABLE}] table")
    terminal = data.get(TABLE, {})
    if not isinstance(terminal, dict):
        raise ConfigError(f"{TABLE!r} in {shown} must be a table ([{TABLE}])")
    if "env" in terminal and not isinstance(terminal["env"], str):
        raise ConfigError(f"env in [{TABLE}] of {shown} must be a backend name (a string), got {terminal['env']!r}")
    return ConfigFile(path=shown, terminal=terminal)


def resolve_backend_name(
    name: str | None = None, *, environ: Mapping[str, str] | None = None, file: ConfigFile | None = None
) -> tuple[str, str]:
    """(name as given, its source): the argument, else ``TERMINAL_ENV``, else the file, else ``local``."""
    env = os.environ if environ is None else environ
    if name:
        return name, SOURCE_ARGUMENT
    if env.get(BACKEND_ENV_VAR, "").strip():
        return env[BACKEND_ENV_VAR].strip(), f"environment variable {BACKEND_ENV_VAR}"
    if file is not None and file.backend:
        return file.backend, f"{file.path} [{TABLE}] env"
    return DEFAULT_BACKEND, SOURCE_DEFAULT


def resolve_config(
    name: str | None = None,
    options: Mapping[str, Any] | None = None,
    *,
    option_strings: Mapping[str, str] | None = None,
    registry: BackendRegistry | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | ConfigFile | None = None,
) -> ResolvedConfig:
    """Pick the backend and build its validated config, recording the source of every value.

    ``options`` are explicit Python values; ``option_strings`` are explicit
    values typed as text (``--option KEY=VALUE``), parsed like environment
    variables. Both rank above everything else; ``options`` wins over
    ``option_strings``.
    """
    if registry is None:
        from .plugins.registry import get_registry

        registry = get_registry()
    env = os.environ if environ is None else environ
    if options is not None and isinstance(options.get("env"), str):
        raise ConfigError(_env_is_not_the_backend(options["env"]))
    file = config_file if isinstance(config_file, ConfigFile) else load_config_file(config_file, environ=env)

    requested, backend_source = resolve_backend_name(name, environ=env, file=file)
    try:
        backend = registry.canonical(requested)
    except BackendNotFoundError as exc:
        if backend_source == SOURCE_ARGUMENT:
            raise
        raise type(exc)(f"{exc} (the backend was chosen by {backend_source})") from exc
    model = registry.config_model(backend)
    fields = model.model_fields

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    ignored: list[IgnoredSetting] = []

    def put(key: str, value: Any, source: str) -> None:
        if key not in fields:
            raise ConfigError(_unknown_key(key, source, backend, fields))
        values[key] = value
        sources[key] = source

    # 1. the file: [terminal] keys, then the selected backend's own table
    if file is not None:
        tables: dict[str, dict[str, Any]] = {}
        for key, value in file.terminal.items():
            if key == "env":
                continue
            if isinstance(value, dict) and _is_backend_table(key, registry):
                tables[key] = value
                continue
            if isinstance(value, dict) and key not in fields:
                raise ConfigError(_unknown_table(key, file.path, registry))
            if key not in fields:
                reason = _not_an_option(key, backend, fields)
                ignored.append(IgnoredSetting(key, f"{file.path} [{TABLE}]", reason))
                continue
            put(key, value, f"{file.path} [{TABLE}]")
        own = [k for k in tables if _canonical_or_none(k, registry) == backend]
        for key in sorted(own, key=lambda k: k == backend):  # alias tables first, so the name's wins
            for sub, value in tables[key].items():
                put(sub, value, f"{file.path} [{TABLE}.{key}]")

    # 2. environment variables
    for var in sorted(env):
        if not var.startswith(FIELD_ENV_PREFIX) or var == BACKEND_ENV_VAR or var in FOREIGN_ENV_VARS:
            continue
        key = var[len(FIELD_ENV_PREFIX) :].lower()
        source = f"environment variable {var}"
        if key not in fields:
            ignored.append(IgnoredSetting(key, source, _not_an_option(key, backend, fields)))
            continue
        put(key, parse_option_string(model, key, env[var], source), source)

    # 3. explicit arguments
    for key, raw in (option_strings or {}).items():
        source = f"--option {key}"
        if key not in fields:
            raise ConfigError(_unknown_key(key, source, backend, fields))
        put(key, parse_option_string(model, key, raw, source), source)
    for key, value in (options or {}).items():
        put(key, value, SOURCE_ARGUMENT)

    try:
        config = model.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc, backend, sources, file)) from None
    if ignored:
        ignored = _mark_misspellings(ignored, fields, registry)
        for item in ignored:
            if item.misspelt:
                warnings.warn(item.warning(), ConfigWarning, stacklevel=_stacklevel_outside_package())

    effective = {key: ConfigValue(getattr(config, key), sources.get(key, SOURCE_DEFAULT)) for key in fields}
    return ResolvedConfig(
        backend=backend,
        backend_source=backend_source,
        config=config,
        values=types.MappingProxyType(effective),
        config_file=file.path if file is not None else None,
        ignored=tuple(ignored),
    )


_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([bkmgt])(?:i?b)?$", re.IGNORECASE)
_SIZE_SCALE = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _memory_size(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f'a memory size is a string with a unit, such as "2g" or "512m"; got {value!r}')
    m = _SIZE_RE.match(value.strip())
    if m is None:
        raise ValueError(
            f'not a memory size: {value!r} (a number and a unit b, k, m, g or t, such as "2g" or "512m")'
        )
    number = m.group(1)
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    if float(number) <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return f"{number}{m.group(2).lower()}"


#: A memory size as every backend spells it: ``"512m"``, ``"2g"``, ``"1.5g"`` (binary units; b, k, m, g, t;
#: ``"2G"``, ``"2GiB"`` and ``"2gb"`` are read as ``"2g"``). Convert with ``memory_bytes()``.
MemorySize = Annotated[str, BeforeValidator(_memory_size)]


def memory_bytes(size: str) -> int:
    """Bytes in a ``MemorySize`` string (``"512m"`` -> 536870912)."""
    m = _SIZE_RE.match(str(_memory_size(size)))
    assert m is not None
    return int(float(m.group(1)) * _SIZE_SCALE[m.group(2).lower()])


def parse_option_string(model: type[BaseModel], key: str, raw: str, source: str) -> Any:
    """Turn a text value into what pydantic should validate: JSON for collections, else the text."""
    info = model.model_fields[key]
    annotation = info.annotation
    if raw.strip() == "null" and _accepts_none(annotation):
        return None
    if _wants_json(annotation):
        try:
            return json.loads(raw)
        except ValueError as exc:
            if _accepts_str(annotation):
                return raw
            raise ConfigError(
                f'{source}: option {key!r} takes JSON (for example ["a", "b"]), got {raw!r}: {exc}'
            ) from None
    return raw


# -- helpers -------------------------------------------------------------------


def _is_backend_table(key: str, registry: BackendRegistry) -> bool:
    from .plugins.registry import KNOWN_BACKENDS

    k = key.lower()
    return k in registry.backends or k in registry.aliases or k in KNOWN_BACKENDS or k in registry.conflicts


def _canonical_or_none(key: str, registry: BackendRegistry) -> str | None:
    k = key.lower()
    if k in registry.backends:
        return k
    return registry.aliases.get(k)


def _arms(annotation: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return tuple(a for arm in typing.get_args(annotation) for a in _arms(arm))
    if origin is typing.Annotated:
        return _arms(typing.get_args(annotation)[0])
    return (annotation,)


def _accepts_none(annotation: Any) -> bool:
    return any(a is type(None) or a is None for a in _arms(annotation))


def _accepts_str(annotation: Any) -> bool:
    return any(a is str or a is typing.Any for a in _arms(annotation))


def _wants_json(annotation: Any) -> bool:
    for arm in _arms(annotation):
        origin = typing.get_origin(arm) or arm
        if isinstance(origin, type):
            if issubclass(origin, BaseModel):
                return True
            if issubclass(origin, (str, bytes)):
                continue
            if issubclass(origin, (collections.abc.Mapping, collections.abc.Collection)):
                return True
    return False


def _stacklevel_outside_package() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside hermes_env_core (the user's line)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back
        level += 1
    return level


def _mark_misspellings(
    ignored: list[IgnoredSetting], fields: Mapping[str, Any], registry: BackendRegistry
) -> list[IgnoredSetting]:
    """Flag the ignored settings that no backend has and that look like an option's misspelling.

    A ``TERMINAL_*`` variable counts only with a close match (the environment
    holds other programs' variables too); a key of the file's ``[terminal]``
    table always does, since that table is hermes-env's own.
    """
    every: set[str] = set(fields)
    for name in registry.backends:
        try:
            every.update(registry.config_model(name).model_fields)
        except Exception:  # noqa: BLE001 - a broken plugin must not break resolving another backend
            continue
    out = []
    for item in ignored:
        if item.key in every:
            out.append(item)
            continue
        close = difflib.get_close_matches(item.key, list(fields), n=1) or difflib.get_close_matches(
            item.key, sorted(every), n=1
        )
        suggestion = close[0] if close else None
        from_env = item.source.startswith("environment variable ")
        misspelt = suggestion is not None or not from_env
        out.append(IgnoredSetting(item.key, item.source, item.reason, misspelt=misspelt, suggestion=suggestion))
    return out


def _env_is_not_the_backend(value: str) -> str:
    return (
        f"env={value!r}: in Python, env is the dict of environment variables for commands "
        f"(env={{'DEBUG': '1'}}), not the backend; to choose the backend, pass backend={value!r} "
        f"(create_environment(backend={value!r}, ...))"
    )


def _unknown_key(key: str, source: str, backend: str, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    known = ", ".join(sorted(fields))
    return f"unknown option {key!r} for backend {backend!r} (from {source}){hint} Known options: {known}."


def _not_an_option(key: str, backend: str, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"not an option of backend {backend!r}{hint}"


def _unknown_table(key: str, path: str, registry: BackendRegistry) -> str:
    from .plugins.registry import KNOWN_BACKENDS

    names = sorted(set(registry.backends) | set(registry.aliases) | set(KNOWN_BACKENDS))
    close = difflib.get_close_matches(key.lower(), names, n=1)
    hint = f"; did you mean [{TABLE}.{close[0]}]?" if close else "."
    return (
        f"unknown table [{TABLE}.{key}] in {path}: {key!r} is neither a backend nor an option{hint} "
        f"Backends: {', '.join(names)}."
    )


def _validation_message(exc: ValidationError, backend: str, sources: Mapping[str, str], file: ConfigFile | None) -> str:
    problems = []
    for err in exc.errors():
        loc = err.get("loc") or ()
        key = str(loc[0]) if loc else "?"
        if err.get("type") == "missing":
            where = file.path if file is not None else DEFAULT_CONFIG_FILE
            problems.append(
                f"backend {backend!r} needs option {key!r}: pass {key}=..., set "
                f"{FIELD_ENV_PREFIX}{key.upper()}, or set {key} in [{TABLE}.{backend}] of {where}"
            )
            continue
        source = sources.get(key, SOURCE_DEFAULT)
        sub = "".join(f"[{p!r}]" for p in loc[1:])
        got = err.get("input")
        shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
        problems.append(f"invalid option {key}{sub} for backend {backend!r} from {source}: {err.get('msg')}{shown}")
    return "; ".join(problems) or f"invalid options for backend {backend!r}: {exc}"
