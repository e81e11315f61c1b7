"""``BackendSpec``: the record a plugin returns to say "I provide this backend".

A spec names its class by a ``"package.module:Class"`` string so that listing
backends never imports one; the class is imported when the backend is created.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["BackendSpec", "split_target"]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]*$")
_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def split_target(target: str) -> tuple[str, str]:
    """``"pkg.mod:Class"`` -> ``("pkg.mod", "Class")``."""
    if not _TARGET_RE.match(target):
        raise ValueError(f"target {target!r} is not of the form 'package.module:Attribute'")
    module, _, attr = target.partition(":")
    return module, attr


@dataclass(frozen=True)
class BackendSpec:
    """One backend a plugin provides.

    ``name`` and ``aliases`` are what users type (lower case, ``[a-z0-9_-]``).
    ``target`` and a string ``config_model`` are imported only when the backend
    is created (or its options resolved); a class there is used as is, which
    suits tests but makes the plugin module import it. ``install_hint`` is shown
    when the target cannot be imported (a missing SDK). ``requires`` names the
    modules the backend imports beyond the core (its SDK, e.g. ``("docker",)``):
    ``hermes-env backends`` looks for them without importing them, so that a
    backend whose SDK is missing is listed as not loadable. ``distribution`` is
    filled in by the plugin manager from the entry point's distribution; any
    value a plugin puts there is overwritten.
    """

    name: str
    target: str
    summary: str = ""
    aliases: tuple[str, ...] = ()
    install_hint: str | None = None
    config_model: str | type[Any] | None = None
    requires: tuple[str, ...] = ()
    distribution: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"backend name {self.name!r} must match {_NAME_RE.pattern}")
        if isinstance(self.aliases, str):
            # ("docker") is a common slip for ("docker",)
            object.__setattr__(self, "aliases", (self.aliases,))
        else:
            object.__setattr__(self, "aliases", tuple(self.aliases))
        for alias in self.aliases:
            if not isinstance(alias, str) or not _NAME_RE.match(alias):
                raise ValueError(f"alias {alias!r} of backend {self.name!r} must match {_NAME_RE.pattern}")
            if alias == self.name:
                raise ValueError(f"backend {self.name!r} lists its own name as an alias")
        requires = (self.requires,) if isinstance(self.requires, str) else tuple(self.requires)
        for module in requires:
            if not isinstance(module, str) or not _MODULE_RE.match(module):
                raise ValueError(f"requires of backend {self.name!r}: {module!r} is not a module name")
        object.__setattr__(self, "requires", requires)
        split_target(self.target)
        if isinstance(self.config_model, str):
            split_target(self.config_model)
        elif self.config_model is not None and not isinstance(self.config_model, type):
            raise ValueError(f"config_model of backend {self.name!r} must be a 'pkg.mod:Model' string or a class")

    @property
    def names(self) -> tuple[str, ...]:
        """The name followed by the aliases."""
        return (self.name, *self.aliases)

    @property
    def module(self) -> str:
        """The module ``target`` lives in."""
        return split_target(self.target)[0]

    def with_distribution(self, distribution: str | None) -> BackendSpec:
        return replace(self, distribution=distribution)
