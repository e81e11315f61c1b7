"""``BackendSpec``: the record a plugin returns to say "I provide this backend".

A spec names its class by a ``"package.module:Class"`` string so that listing
backends never imports one; the class is imported when the backend is created.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "API_VERSION",
    "UNPUBLISHED",
    "BackendSpec",
    "api_refusal",
    "checkout_install",
    "parse_api_version",
    "split_target",
]

#: The version of the plugin API: the ``Target`` protocol, ``TargetEnvironment``,
#: the ``hermes_env_backends`` hookspec and ``BackendSpec``. A minor version may
#: add (optional methods and fields with defaults, capabilities); only a major
#: version may remove or change what a plugin already uses.
API_VERSION = "1.0"

#: This project's distributions, not on the package index yet, and where each lives in a checkout.
#: An install hint names that path: ``pip install hermes-env-modal`` would find nothing.
UNPUBLISHED: dict[str, str] = {
    "hermes-env-core": ".",
    "hermes-env-modal": "plugins/hermes-env-modal",
    "hermes-env-daytona": "plugins/hermes-env-daytona",
    "hermes-env-singularity": "plugins/hermes-env-singularity",
    "hermes-env-example": "examples/hermes-env-example",
    "hermes-env-kubernetes": "examples/hermes-env-kubernetes",
}


def checkout_install(distribution: str, *, upgrade: bool = False) -> str:
    """The command that installs ``distribution``: its path in a hermes-env checkout while it is unpublished."""
    flag = "-U " if upgrade else ""
    path = UNPUBLISHED.get(distribution)
    if path is None:
        return f"pip install {flag}{distribution}"
    where = "." if path == "." else f"./{path}"
    return f"pip install {flag}{where} in a hermes-env checkout; {distribution} is not on PyPI yet"


def parse_api_version(text: str) -> tuple[int, int]:
    """``"1.0"`` -> ``(1, 0)``; ``ValueError`` naming the value for anything else."""
    major, dot, minor = str(text).partition(".")
    if not (dot and major.isascii() and major.isdigit() and minor.isascii() and minor.isdigit()):
        raise ValueError(f"plugin API version {text!r} is not of the form MAJOR.MINOR (such as {API_VERSION!r})")
    return int(major), int(minor)


def api_refusal(spec: BackendSpec, *, plugin: str, core: str) -> str | None:
    """Why ``spec`` cannot be loaded by this core (another major API version), or None.

    ``plugin`` names the plugin (its distribution and version), ``core`` the
    installed hermes-env-core (name and version).
    """
    theirs, ours = parse_api_version(spec.api_version)[0], parse_api_version(API_VERSION)[0]
    if theirs == ours:
        return None
    dist = spec.distribution or "the plugin"
    if theirs > ours:
        fix = (
            f"upgrade hermes-env-core to a release with plugin API {theirs}.x "
            f"({checkout_install('hermes-env-core', upgrade=True)})"
        )
    else:
        fix = (
            f"upgrade {dist} to a release built for plugin API {ours}.x ({checkout_install(dist, upgrade=True)}), "
            f"or use a hermes-env-core with plugin API {theirs}.x"
        )
    return (
        f"{plugin} is built for hermes-env plugin API {spec.api_version} (backend {spec.name!r}), but {core} "
        f"provides plugin API {API_VERSION}; a different major version is incompatible: {fix}"
    )

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
    value a plugin puts there is overwritten. ``api_version`` is the plugin API
    the backend was built for (leave the default: the ``API_VERSION`` of the
    core it was built against); another major version is refused at load.
    """

    name: str
    target: str
    summary: str = ""
    aliases: tuple[str, ...] = ()
    install_hint: str | None = None
    config_model: str | type[Any] | None = None
    requires: tuple[str, ...] = ()
    distribution: str | None = field(default=None, compare=False)
    api_version: str = API_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.api_version, str):
            raise ValueError(f"api_version of backend {self.name!r} must be a string such as {API_VERSION!r}")
        parse_api_version(self.api_version)
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
