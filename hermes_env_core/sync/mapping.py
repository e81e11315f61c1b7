"""What to sync (``SyncMapping``) and the engine's bookkeeping for one mapping.

The bookkeeping is the engine's alone: what was pushed, by (mtime, size, mode)
and SHA-256, per path relative to the mapping root.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field

from ..errors import ConfigError
from .filters import DEFAULT_EXCLUDES, PathFilter, Stat, scan_tree

__all__ = ["MappingState", "SyncMapping"]

_S_IFMT = 0o170000


@dataclass(frozen=True)
class SyncMapping:
    """A host path mirrored at a remote path.

    ``host`` is a directory (its tree is synced) or a single file. ``remote``
    is absolute, or relative to the target's default directory (``~/x`` is
    read as ``x``). ``include``/``exclude`` are globs as ``PathFilter`` reads
    them; passing ``exclude`` replaces the defaults (``DEFAULT_EXCLUDES``).
    ``upload_only`` mappings (credentials) are pushed but never pulled back:
    nothing the target does to them reaches the host.
    """

    host: str | os.PathLike[str]
    remote: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = DEFAULT_EXCLUDES
    upload_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "host", os.fspath(self.host))
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigError(f"SyncMapping.{name} must be a list of globs, not the string {value!r}")
            object.__setattr__(self, name, tuple(value))


def split_remote(remote: str) -> tuple[str, str]:
    """(anchor, path below it): anchor ``/`` for absolute paths, ``.`` for
    paths relative to the target's default directory."""
    if not isinstance(remote, str) or not remote.strip():
        raise ConfigError(f"SyncMapping.remote must be a path, not {remote!r}")
    raw = remote
    if raw == "~" or raw.startswith("~/"):
        raw = raw[2:]
    elif raw.startswith("~"):
        raise ConfigError(f"SyncMapping.remote {remote!r}: '~user' is not supported; use an absolute path")
    anchor = "/" if raw.startswith("/") else "."
    rel = posixpath.normpath(raw).lstrip("/")
    if rel in ("", ".") or rel == ".." or rel.startswith("../"):
        raise ConfigError(
            f"SyncMapping.remote {remote!r} must name a directory or file below "
            f"{'/' if anchor == '/' else 'the target home'}, not the root itself or outside it"
        )
    return anchor, rel


@dataclass
class MappingState:
    """One mapping, resolved, with what the engine last pushed for it."""

    mapping: SyncMapping
    host_root: str  # real path of the directory, or of the file
    is_file: bool
    anchor: str
    remote_rel: str  # below the anchor
    filter: PathFilter
    foreign: tuple[str, ...] = ()  # paths below remote_rel that belong to other mappings
    stats: dict[str, Stat] = field(default_factory=dict)
    hashes: dict[str, bytes] = field(default_factory=dict)
    doubt: set[str] = field(default_factory=set)  # remote state unknown after a failed push

    @classmethod
    def resolve(cls, mapping: SyncMapping) -> MappingState:
        host = os.path.realpath(os.path.expanduser(mapping.host))
        anchor, rel = split_remote(mapping.remote)
        is_file = os.path.lexists(host) and not os.path.isdir(host)
        return cls(mapping, host, is_file, anchor, rel, PathFilter(mapping.include, mapping.exclude))

    # -- paths ------------------------------------------------------------------
    @property
    def remote_path(self) -> str:
        """The mapping's remote path, as the transport takes it."""
        return "/" + self.remote_rel if self.anchor == "/" else self.remote_rel

    @property
    def display(self) -> str:
        return f"{self.mapping.host} -> {self.mapping.remote}"

    def host_path(self, rel: str) -> str:
        if self.is_file:
            return self.host_root
        return os.path.join(self.host_root, *rel.split("/"))

    def member(self, rel: str) -> str:
        """The name of ``rel`` in an upload archive (relative to the anchor)."""
        return self.remote_rel if self.is_file else f"{self.remote_rel}/{rel}"

    def download_args(self) -> tuple[str, str | None]:
        """(remote root, subpath) to download this mapping's tree."""
        if not self.is_file:
            return self.remote_path, None
        head, tail = posixpath.split(self.remote_path)
        return head or ".", tail

    def lock_path(self) -> str:
        return self.host_root

    # -- filtering and scanning --------------------------------------------------
    def scan(self) -> dict[str, Stat]:
        if not self.is_file:
            tree = scan_tree(self.host_root, self.filter)
            if self.foreign:
                # Another mapping owns these remote paths; pushing ours there too would fight it.
                tree = {rel: st for rel, st in tree.items() if self.accepts(rel)}
            return tree
        try:
            st = os.lstat(self.host_root)
        except OSError:
            return {}
        if st.st_mode & _S_IFMT not in (0o100000, 0o120000):
            return {}
        return {posixpath.basename(self.remote_rel): (st.st_mtime_ns, st.st_size, st.st_mode)}

    def accepts(self, rel: str, is_dir: bool = False) -> bool:
        """Whether a path of the pulled tree belongs to this mapping."""
        if self.is_file:
            return not is_dir and rel == posixpath.basename(self.remote_rel)
        for f in self.foreign:
            if rel == f or rel.startswith(f + "/"):
                return False
        return self.filter.accepts(rel, is_dir=is_dir)

    def set_foreign(self, others: list[MappingState]) -> None:
        """Remember the other mappings whose remote paths lie inside this one."""
        if self.is_file:
            return
        out = []
        for other in others:
            if other is self or other.anchor != self.anchor:
                continue
            if other.remote_rel.startswith(self.remote_rel + "/"):
                out.append(other.remote_rel[len(self.remote_rel) + 1 :])
            elif other.remote_rel == self.remote_rel:
                raise ConfigError(
                    f"mappings {self.display!r} and {other.display!r} share a remote path; give each its own"
                )
        self.foreign = tuple(out)
