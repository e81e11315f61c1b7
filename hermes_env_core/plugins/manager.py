"""Finding plugins and asking each for its backends.

Loads the entry points of group ``hermes_env`` and registers each plugin with
pluggy; a plugin that fails is recorded with the reason, never raised here.
A hook implementation that no hookspec declares (a misspelt
``hermes_env_backend``), or a ``hermes_env_*`` function not marked
``@hookimpl``, fails its plugin: otherwise its backends would silently vanish.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import pluggy

from . import hookspecs
from .hookspecs import ENTRY_POINT_GROUP, HOOK_PREFIX, PROJECT_NAME
from .spec import BackendSpec, api_refusal

__all__ = ["CORE_DISTRIBUTION", "LoadedPlugin", "PluginInfo", "PluginLoadWarning", "PluginManager"]

CORE_DISTRIBUTION = "hermes-env-core"


class PluginLoadWarning(UserWarning):
    """A plugin could not be loaded, or two plugins provide the same name; it is disabled."""


@dataclass(frozen=True)
class PluginInfo:
    """One plugin as found: where it comes from, what it provides, whether it loaded."""

    name: str
    distribution: str | None = None
    version: str | None = None
    value: str | None = None  # the entry point's "pkg.module[:attr]"
    backends: tuple[str, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def source(self) -> str:
        """How to name this plugin in a message."""
        if self.distribution:
            return self.distribution if not self.version else f"{self.distribution} {self.version}"
        return f"plugin {self.name!r}"


@dataclass(frozen=True)
class LoadedPlugin:
    info: PluginInfo
    specs: tuple[BackendSpec, ...]
    plugin: object | None = None


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    # Name the plugin's own line that raised, not the import machinery's.
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {first}{where}" if first else f"{type(exc).__name__}{where}"


class PluginManager:
    """A pluggy manager for project ``hermes_env`` that isolates plugins from each other."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)

    @property
    def pluggy(self) -> pluggy.PluginManager:
        return self._pm

    def is_registered(self, plugin: object) -> bool:
        return self._pm.is_registered(plugin)

    def unregister(self, plugin: object) -> None:
        if self._pm.is_registered(plugin):
            self._pm.unregister(plugin)

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> list[LoadedPlugin]:
        """Load every entry point of ``group``; the core's first, then by distribution and name."""
        eps = list(importlib.metadata.entry_points(group=group))

        def order(ep: Any) -> tuple[int, str, str]:
            dist = _dist_name(ep) or ""
            return (0 if dist == CORE_DISTRIBUTION else 1, dist.lower(), ep.name)

        loaded: list[LoadedPlugin] = []
        for ep in sorted(eps, key=order):
            dist, version = _dist_name(ep), _dist_version(ep)
            base = PluginInfo(name=ep.name, distribution=dist, version=version, value=ep.value)
            try:
                plugin = ep.load()
            except (Exception, SystemExit) as exc:
                loaded.append(LoadedPlugin(_with(base, error=_reason(exc)), ()))
                continue
            loaded.append(self._register(plugin, base))
        return loaded

    def register(
        self, plugin: object, *, name: str | None = None, distribution: str | None = None, version: str | None = None
    ) -> LoadedPlugin:
        """Register a plugin object (a module, class or instance with hook implementations)."""
        pname = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        return self._register(plugin, PluginInfo(name=pname, distribution=distribution, version=version))

    def _register(self, plugin: object, info: PluginInfo) -> LoadedPlugin:
        if self._pm.is_registered(plugin):
            return LoadedPlugin(_with(info, error="the same plugin object is already registered"), ())
        pname = f"{info.distribution or ''}:{info.name}"
        if self._pm.get_plugin(pname) is not None:
            pname = f"{pname}#{id(plugin)}"
        try:
            self._pm.register(plugin, name=pname)
        except (Exception, SystemExit) as exc:
            return LoadedPlugin(_with(info, error=_reason(exc)), ())
        problem = self._unknown_hooks(plugin)
        if problem:
            self._pm.unregister(plugin)
            return LoadedPlugin(_with(info, error=problem), ())
        try:
            specs = self._call(plugin, info)
        except _BadResult as exc:
            self._pm.unregister(plugin)
            return LoadedPlugin(_with(info, error=str(exc)), ())
        except (Exception, SystemExit) as exc:
            self._pm.unregister(plugin)
            return LoadedPlugin(_with(info, error=f"hermes_env_backends() failed: {_reason(exc)}"), ())
        return LoadedPlugin(_with(info, backends=tuple(s.name for s in specs)), tuple(specs), plugin)

    def known_hooks(self) -> list[str]:
        """The hook names a plugin may implement."""
        return sorted(name for name, caller in vars(self._pm.hook).items() if getattr(caller, "has_spec", None) and caller.has_spec())

    def _unknown_hooks(self, plugin: object) -> str | None:
        # What pluggy's check_pending() finds, but for this plugin alone, plus unmarked hook-like functions.
        unknown = sorted(
            caller.name
            for caller in self._pm.get_hookcallers(plugin) or []
            if not caller.has_spec()
            and not all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin)
        )
        unmarked = sorted(
            name
            for name in dir(plugin)
            if name.startswith(HOOK_PREFIX)
            and inspect.isroutine(getattr(plugin, name, None))
            and self._pm.parse_hookimpl_opts(plugin, name) is None
        )
        known = ", ".join(self.known_hooks())
        if unknown:
            return (
                f"implements hook {', '.join(map(repr, unknown))}, which no hermes-env hookspec declares "
                f"(known hooks: {known}); is it misspelt?"
            )
        if unmarked:
            return (
                f"defines {', '.join(map(repr, unmarked))} without @hookimpl, so pluggy ignores it "
                f"(mark it with hermes_env_core.hookimpl; known hooks: {known})"
            )
        return None

    def _call(self, plugin: object, info: PluginInfo) -> list[BackendSpec]:
        others = [p for p in self._pm.get_plugins() if p is not plugin]
        caller = self._pm.subset_hook_caller("hermes_env_backends", remove_plugins=others)
        specs: list[BackendSpec] = []
        for result in caller():
            for item in _iterate(result):
                if not isinstance(item, BackendSpec):
                    raise _BadResult(f"hermes_env_backends() returned {item!r}, not a BackendSpec")
                specs.append(item.with_distribution(info.distribution))
        for spec in specs:
            refusal = api_refusal(spec, plugin=info.source, core=_core_source())
            if refusal is not None:
                raise _BadResult(refusal)
        return specs


class _BadResult(Exception):
    pass


def _iterate(result: object) -> Iterable[object]:
    if result is None:
        return ()
    if isinstance(result, BackendSpec):
        return (result,)
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise _BadResult(f"hermes_env_backends() returned {result!r}, not an iterable of BackendSpec")
    return list(result)


def _with(info: PluginInfo, **changes: Any) -> PluginInfo:
    return replace(info, **changes)


def _core_source() -> str:
    try:
        return f"{CORE_DISTRIBUTION} {importlib.metadata.version(CORE_DISTRIBUTION)}"
    except importlib.metadata.PackageNotFoundError:
        return CORE_DISTRIBUTION


def _dist_name(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    try:
        name = dist.metadata["Name"] or dist.name
        return str(name) if name else None
    except Exception:
        return getattr(dist, "name", None)


def _dist_version(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    try:
        return dist.version if dist is not None else None
    except Exception:
        return None
