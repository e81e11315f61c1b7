"""The backend registry: names to lazily imported classes, and lookup errors that say what to do.

Built from every plugin's ``hermes_env_backends()``; the public view is
read-only and a backend's module is imported only when it is first loaded.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import os
import re
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..errors import (
    BackendNotFoundError,
    BackendNotInstalledError,
    DuplicateBackendError,
    PluginLoadError,
)
from .hookspecs import ENTRY_POINT_GROUP
from .manager import (
    CORE_DISTRIBUTION,
    LoadedPlugin,
    PluginInfo,
    PluginLoadWarning,
    PluginManager,
)
from .spec import BackendSpec, checkout_install, split_target

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ..environment.base import BaseEnvironment

__all__ = [
    "KNOWN_BACKENDS",
    "STRICT_ENV_VAR",
    "BackendRegistry",
    "KnownBackend",
    "get_registry",
    "reset_registry",
    "strict_from_env",
]

STRICT_ENV_VAR = "HERMES_ENV_STRICT_PLUGINS"
_REQ_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class KnownBackend:
    """A backend published separately: which distribution to install for it."""

    name: str
    distribution: str

    @property
    def install_hint(self) -> str:
        return checkout_install(self.distribution)


#: Names users may know from the docs, mapped to where they come from.
KNOWN_BACKENDS: Mapping[str, KnownBackend] = MappingProxyType(
    {
        "modal": KnownBackend("modal", "hermes-env-modal"),
        "daytona": KnownBackend("daytona", "hermes-env-daytona"),
        "singularity": KnownBackend("singularity", "hermes-env-singularity"),
        "apptainer": KnownBackend("singularity", "hermes-env-singularity"),
    }
)


def strict_from_env(environ: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(STRICT_ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def _key(name: str) -> str:
    return name.strip().lower()


def _norm_dist(name: str | None) -> str:
    return (name or "").lower().replace("_", "-").replace(".", "-")


class BackendRegistry:
    """Every installed backend, by name and alias.

    ``BackendRegistry()`` loads the entry points of group ``hermes_env``. A
    plugin that fails to import is warned about and listed in ``failed``; it is
    an error only when a backend it may provide is asked for, or at once when
    ``strict`` (default: ``HERMES_ENV_STRICT_PLUGINS=1``). A name provided twice
    by discovered plugins is likewise an error when looked up (or at once when
    strict); ``register()`` of a clashing plugin raises at once.
    """

    def __init__(
        self, *, entry_points: bool = True, strict: bool | None = None, group: str = ENTRY_POINT_GROUP
    ) -> None:
        self.strict = strict_from_env() if strict is None else strict
        self._manager = PluginManager()
        self._lock = threading.RLock()
        self._plugins: list[PluginInfo] = []
        self._specs: dict[str, BackendSpec] = {}
        self._by_key: dict[str, BackendSpec] = {}
        self._conflicts: dict[str, list[BackendSpec]] = {}
        self._provider: dict[str, PluginInfo] = {}
        self._classes: dict[str, type[BaseEnvironment]] = {}
        self._models: dict[str, type[BaseModel]] = {}
        if entry_points:
            loaded = self._manager.load_entry_points(group)
            from . import builtin

            if group == ENTRY_POINT_GROUP and not any(lp.plugin is builtin for lp in loaded):
                # Running from a source tree without the core's metadata installed.
                loaded.insert(0, self._manager.register(builtin, name="core", distribution=CORE_DISTRIBUTION))
            for lp in loaded:
                self._add(lp, raise_on_conflict=False)
            for info in self.failed:
                warnings.warn(
                    f"hermes-env plugin {info.name!r} ({info.source}) failed to load and is disabled: {info.error}",
                    PluginLoadWarning,
                    stacklevel=2,
                )
            for key, specs in self._conflicts.items():
                warnings.warn(_duplicate_message(key, specs), PluginLoadWarning, stacklevel=2)
            if self.strict:
                self.raise_for_failures()

    # -- building ---------------------------------------------------------------
    def register(
        self, plugin: object, *, name: str | None = None, distribution: str | None = None, version: str | None = None
    ) -> PluginInfo:
        """Register a plugin object programmatically (tests, embedding applications).

        Raises ``PluginLoadError`` if its hook fails and ``DuplicateBackendError``
        if it provides a name that is already taken; the registry is then unchanged.
        """
        with self._lock:
            lp = self._manager.register(plugin, name=name, distribution=distribution, version=version)
            if not lp.info.ok:
                raise PluginLoadError(f"plugin {lp.info.name!r} ({lp.info.source}) failed to load: {lp.info.error}")
            try:
                self._add(lp, raise_on_conflict=True)
            except DuplicateBackendError:
                self._manager.unregister(plugin)
                raise
            return lp.info

    def _add(self, lp: LoadedPlugin, *, raise_on_conflict: bool) -> None:
        if raise_on_conflict:
            seen: dict[str, BackendSpec] = {}
            for spec in lp.specs:
                for key in spec.names:
                    other = self._by_key.get(key) or seen.get(key)
                    if other is not None:
                        raise DuplicateBackendError(_duplicate_message(key, [other, spec]))
                    seen[key] = spec
        self._plugins.append(lp.info)
        for spec in lp.specs:
            for key in spec.names:
                other = self._by_key.get(key)
                if other is None:
                    self._by_key[key] = spec
                else:
                    self._conflicts.setdefault(key, [other]).append(spec)
            if spec.name not in self._specs:
                self._specs[spec.name] = spec
                self._provider[spec.name] = lp.info

    def raise_for_failures(self) -> None:
        """Raise for the first failed plugin or clashing name, if any (what strict mode does)."""
        failed = self.failed
        if failed:
            lines = "; ".join(f"{i.name!r} ({i.source}): {i.error}" for i in failed)
            raise PluginLoadError(f"{len(failed)} hermes-env plugin(s) failed to load: {lines}")
        for key, specs in self._conflicts.items():
            raise DuplicateBackendError(_duplicate_message(key, specs))

    # -- read-only views ----------------------------------------------------------
    @property
    def backends(self) -> Mapping[str, BackendSpec]:
        """Canonical name -> spec, in registration order (read-only)."""
        return MappingProxyType(self._specs)

    @property
    def aliases(self) -> Mapping[str, str]:
        """Every alias -> the canonical name it stands for (read-only)."""
        return MappingProxyType({k: s.name for k, s in self._by_key.items() if k != s.name})

    @property
    def plugins(self) -> tuple[PluginInfo, ...]:
        return tuple(self._plugins)

    @property
    def failed(self) -> tuple[PluginInfo, ...]:
        return tuple(p for p in self._plugins if not p.ok)

    @property
    def conflicts(self) -> Mapping[str, tuple[BackendSpec, ...]]:
        """Names or aliases provided more than once -> every spec providing them."""
        return MappingProxyType({k: tuple(v) for k, v in self._conflicts.items()})

    def names(self) -> list[str]:
        """Installed backend names (not aliases), sorted."""
        return sorted(self._specs)

    def provider(self, name: str) -> PluginInfo | None:
        """The plugin that provides backend ``name`` (canonical name or alias)."""
        spec = self._by_key.get(_key(name))
        return self._provider.get(spec.name) if spec else None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _key(name) in self._by_key and _key(name) not in self._conflicts

    # -- lookup -------------------------------------------------------------------
    def resolve(self, name: str) -> BackendSpec:
        """The spec for a name or alias, or an error saying what to do."""
        key = _key(name)
        if key in self._conflicts:
            raise DuplicateBackendError(_duplicate_message(key, self._conflicts[key]))
        spec = self._by_key.get(key)
        if spec is not None:
            if spec.name in self._conflicts:
                raise DuplicateBackendError(_duplicate_message(spec.name, self._conflicts[spec.name]))
            return spec
        known = KNOWN_BACKENDS.get(key)
        for info in self.failed:
            if _may_provide(info, key, known):
                raise PluginLoadError(
                    f"backend {key!r} may come from plugin {info.name!r} ({info.source}), "
                    f"which failed to load: {info.error}"
                )
        if known is not None:
            what = f"backend {key!r}" if known.name == key else f"backend {key!r} (alias of {known.name!r})"
            raise BackendNotInstalledError(
                f"{what} is provided by {known.distribution}, which is not installed: {known.install_hint}"
            )
        raise BackendNotFoundError(self._unknown_message(name))

    def canonical(self, name: str) -> str:
        return self.resolve(name).name

    def _unknown_message(self, name: str) -> str:
        key = _key(name)
        candidates = sorted(set(self._by_key) | set(KNOWN_BACKENDS))
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        parts = [f"unknown backend {name!r}"]
        if close:
            hint = close[0]
            if hint in self._by_key:
                target = self._by_key[hint].name
                parts.append(f"did you mean {hint!r}?" if target == hint else f"did you mean {hint!r} ({target})?")
            else:
                parts.append(f"did you mean {hint!r} ({KNOWN_BACKENDS[hint].install_hint})?")
        installed = ", ".join(self.names()) or "none"
        message = "; ".join(parts)
        message += (" " if message.endswith("?") else ". ") + f"Installed backends: {installed}."
        if self.failed:
            message += f" {len(self.failed)} plugin(s) failed to load; see `hermes-env backends`."
        else:
            message += " If it comes from a plugin, that plugin may not be installed."
        return message

    # -- loading ------------------------------------------------------------------
    def load(self, name: str) -> type[BaseEnvironment]:
        """Import (once) and return the class of backend ``name``."""
        spec = self.resolve(name)
        with self._lock:
            cls = self._classes.get(spec.name)
            if cls is not None:
                return cls
            from ..environment.base import BaseEnvironment

            obj = _import(spec, spec.target, "backend class")
            if not (isinstance(obj, type) and issubclass(obj, BaseEnvironment)):
                raise PluginLoadError(
                    f"backend {spec.name!r} ({spec.distribution or 'unknown distribution'}): "
                    f"{spec.target} is {obj!r}, not a BaseEnvironment subclass"
                )
            self._classes[spec.name] = obj
            return obj

    def config_model(self, name: str) -> type[BaseModel]:
        """The pydantic model of backend ``name``'s options (imported once)."""
        spec = self.resolve(name)
        with self._lock:
            model = self._models.get(spec.name)
            if model is not None:
                return model
            from pydantic import BaseModel

            if spec.config_model is None:
                obj: Any = getattr(self.load(spec.name), "config_model", None)
            elif isinstance(spec.config_model, str):
                obj = _import(spec, spec.config_model, "config model")
            else:
                obj = spec.config_model
            if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
                raise PluginLoadError(
                    f"backend {spec.name!r} ({spec.distribution or 'unknown distribution'}): "
                    f"its config model {obj!r} is not a pydantic model"
                )
            self._models[spec.name] = obj
            return obj

    def availability(self, name: str) -> tuple[bool, str | None]:
        """Whether backend ``name`` can be loaded, and if not why, found without importing anything.

        Looks for the backend's module and the modules its spec ``requires``
        (its SDK), and checks that its distribution's own requirements are
        installed. Importing would run SDKs: listing backends must stay cheap and safe.
        """
        spec = self.resolve(name)
        hint = f": {spec.install_hint}" if spec.install_hint else ""
        if spec.name in self._conflicts:
            return False, "name provided twice: " + " and ".join(
                s.distribution or "?" for s in self._conflicts[spec.name]
            )
        try:
            found = importlib.util.find_spec(spec.module)
        except (ImportError, ValueError) as exc:
            return False, f"cannot locate {spec.module}: {exc}"
        if found is None:
            return False, f"module {spec.module} not found; reinstall {spec.distribution or 'its plugin'}"
        for module in spec.requires:
            try:
                present = importlib.util.find_spec(module.partition(".")[0]) is not None
            except (ImportError, ValueError):
                present = False
            if not present:
                return False, f"needs {module!r}, which is not installed{hint}"
        missing = _missing_requirements(spec.distribution)
        if missing:
            return False, f"{spec.distribution} needs {', '.join(missing)}, not installed{hint}"
        return True, None

    def is_loaded(self, name: str) -> bool:
        """Whether backend ``name``'s class has been imported through this registry."""
        spec = self._by_key.get(_key(name))
        return spec is not None and spec.name in self._classes


def _missing_requirements(distribution: str | None) -> list[str]:
    """The unconditional requirements of ``distribution`` that are not installed (markers are skipped)."""
    if not distribution:
        return []
    try:
        requires = importlib.metadata.distribution(distribution).requires or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    for req in requires:
        if ";" in req:
            continue  # an extra or an environment marker: not needed here
        m = _REQ_NAME_RE.match(req)
        if m is None:
            continue
        try:
            importlib.metadata.distribution(m.group(0))
        except importlib.metadata.PackageNotFoundError:
            missing.append(m.group(0))
    return missing


def _may_provide(info: PluginInfo, key: str, known: KnownBackend | None) -> bool:
    dist = _norm_dist(info.distribution)
    if known is not None and dist == known.distribution:
        return True
    return key in (_key(info.name), dist, dist.removeprefix("hermes-env-"))


def _duplicate_message(key: str, specs: list[BackendSpec] | tuple[BackendSpec, ...]) -> str:
    sources = []
    for spec in specs:
        source = spec.distribution or "a plugin registered in code"
        what = f"{source} (as {'alias of ' + repr(spec.name) if key != spec.name else 'name'})"
        sources.append(what)
    return (
        f"backend name {key!r} is provided twice: by {' and by '.join(sources)}; "
        "uninstall one of them or ask its authors to rename it"
    )


def _import(spec: BackendSpec, target: str, what: str) -> Any:
    module_name, attr = split_target(target)
    origin = spec.distribution or "unknown distribution"
    hint = f"; to install what it needs: {spec.install_hint}" if spec.install_hint else ""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise PluginLoadError(
                f"backend {spec.name!r} ({origin}): its {what} module {module_name} is missing; "
                f"reinstall {spec.distribution or 'the plugin that provides it'}"
            ) from exc
        raise PluginLoadError(
            f"backend {spec.name!r} ({origin}) needs {missing!r}, which is not installed{hint}"
        ) from exc
    except (Exception, SystemExit) as exc:
        raise PluginLoadError(
            f"backend {spec.name!r} ({origin}): importing {module_name} failed: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    obj: Any = module
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise PluginLoadError(f"backend {spec.name!r} ({origin}): {module_name} has no {what} {attr!r}") from exc
    return obj


_default: BackendRegistry | None = None
_default_lock = threading.Lock()


def get_registry(*, strict: bool | None = None) -> BackendRegistry:
    """The process-wide registry, built on first use.

    ``strict=True`` (or ``HERMES_ENV_STRICT_PLUGINS=1``) raises if any plugin
    failed to load or any name clashes.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = BackendRegistry(strict=strict)
        registry = _default
    if strict or (strict is None and strict_from_env()):
        registry.raise_for_failures()
    return registry


def reset_registry() -> None:
    """Forget the process-wide registry (after installing a plugin at run time)."""
    global _default
    with _default_lock:
        _default = None
