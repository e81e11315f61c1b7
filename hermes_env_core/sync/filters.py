"""Which paths of a mapping are synced: include/exclude globs, and the tree scan.

The scan is the hot path of every push (it runs before each command), so it is
one ``os.scandir`` walk with the filter inlined, not a call per file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from ..errors import ConfigError

__all__ = ["DEFAULT_EXCLUDES", "PathFilter", "Stat", "scan_tree", "translate_glob"]

#: Never synced unless a mapping passes its own ``exclude``. The last two are
#: the engine's own conflict backups and temporary files.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git",
    "node_modules",
    ".venv",
    "__pycache__",
    "*.hermes-conflict-*",
    ".*.hermes-tmp-*",
)

#: (st_mtime_ns, st_size, st_mode) of a regular file or symlink, from lstat.
Stat = tuple[int, int, int]

_S_IFMT = 0o170000
_S_IFREG = 0o100000
_S_IFLNK = 0o120000
_MAGIC = re.compile(r"[*?\[]")


def translate_glob(pattern: str) -> str:
    """Regex source for a glob over ``/``-separated paths.

    ``*`` and ``?`` never match ``/``; ``**`` as a whole component matches any
    number of components (``a/**``, ``**/b``, ``a/**/b``); ``[...]`` is a
    character class (``[!...]`` negated) that never matches ``/``.
    """
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            j = i
            while j < n and pattern[j] == "*":
                j += 1
            whole = j - i == 2 and (i == 0 or pattern[i - 1] == "/") and (j == n or pattern[j] == "/")
            if whole and j == n:
                out.append(".*")
            elif whole:
                out.append("(?:[^/]*/)*")
                j += 1  # the '/' after '**' is part of the repeated group
            else:
                out.append("[^/]*")
            i = j
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal '['
                out.append(re.escape(c))
                i += 1
                continue
            body = pattern[i + 1 : j]
            negate = body[:1] in ("!", "^")
            if negate:
                body = body[1:]
            chars = "".join(ch if ch == "-" else re.escape(ch) for ch in body)
            out.append(f"[^/{chars}]" if negate else f"(?!/)[{chars}]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _compile(patterns: Iterable[str], what: str) -> re.Pattern[str] | None:
    parts = []
    for pat in patterns:
        parts.append(f"(?:{translate_glob(pat)})")
    if not parts:
        return None
    try:
        return re.compile("|".join(parts), re.DOTALL)
    except re.error as exc:
        raise ConfigError(f"invalid {what} glob in {list(patterns)!r}: {exc}") from exc


def _split(patterns: Iterable[str], what: str) -> tuple[frozenset[str], tuple[str, ...], tuple[str, ...]]:
    """(literal names, name globs, path globs) from a list of patterns."""
    literal: set[str] = set()
    names: list[str] = []
    paths: list[str] = []
    for raw in patterns:
        if not isinstance(raw, str) or not raw.strip("/"):
            raise ConfigError(f"{what} glob {raw!r} is empty; give a name like '*.log' or a path like 'build/**'")
        pat = raw.rstrip("/")
        if pat.startswith("/"):
            paths.append(pat.lstrip("/"))
        elif "/" in pat:
            paths.append(pat)
        elif _MAGIC.search(pat):
            names.append(pat)
        else:
            literal.add(pat)
    return frozenset(literal), tuple(names), tuple(paths)


class PathFilter:
    """Include/exclude globs over paths relative to a mapping root.

    A pattern without ``/`` matches any single component, so ``node_modules``
    or ``*.pyc`` exclude at every depth and an excluded directory's whole
    subtree is skipped. A pattern with ``/`` (or a leading ``/``) matches the
    whole relative path from the root. Excludes win over includes; includes
    select files only (by name, or by path), never prune directories; an
    empty include list selects every file.
    """

    __slots__ = ("_ex_literal", "_ex_name", "_ex_path", "_in_literal", "_in_name", "_in_path", "exclude", "include")

    def __init__(self, include: Iterable[str] = (), exclude: Iterable[str] = DEFAULT_EXCLUDES) -> None:
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        lit, names, paths = _split(self.exclude, "exclude")
        self._ex_literal = lit
        self._ex_name = _compile(names, "exclude")
        self._ex_path = _compile(paths, "exclude")
        lit, names, paths = _split(self.include, "include")
        self._in_literal = lit
        self._in_name = _compile(names, "include")
        self._in_path = _compile(paths, "include")

    @property
    def has_includes(self) -> bool:
        return bool(self.include)

    def excludes_name(self, name: str) -> bool:
        """True when one component called ``name`` is excluded wherever it is."""
        return name in self._ex_literal or (self._ex_name is not None and self._ex_name.fullmatch(name) is not None)

    def excludes_path(self, rel: str) -> bool:
        """True when a path glob excludes ``rel`` itself (not its parents)."""
        return self._ex_path is not None and self._ex_path.fullmatch(rel) is not None

    def includes_file(self, rel: str, name: str) -> bool:
        if not self.include:
            return True
        if name in self._in_literal:
            return True
        if self._in_name is not None and self._in_name.fullmatch(name):
            return True
        return self._in_path is not None and self._in_path.fullmatch(rel) is not None

    def accepts(self, rel: str, *, is_dir: bool = False) -> bool:
        """Whether ``rel`` (``a/b/c``, no leading ``./``) is synced.

        Equivalent to what ``scan_tree`` keeps: no component and no parent
        path is excluded, and a file passes the include globs.
        """
        parts = rel.split("/")
        prefix = ""
        for part in parts:
            prefix = f"{prefix}/{part}" if prefix else part
            if self.excludes_name(part) or self.excludes_path(prefix):
                return False
        return is_dir or self.includes_file(rel, parts[-1])

    def hints(self) -> tuple[str, ...]:
        """Component globs a remote ``tar --exclude`` can apply as well (an optimisation)."""
        out = sorted(self._ex_literal)
        out.extend(p for p in self.exclude if "/" not in p.rstrip("/") and _MAGIC.search(p))
        return tuple(out)

    def __repr__(self) -> str:
        return f"PathFilter(include={self.include!r}, exclude={self.exclude!r})"


def scan_tree(root: str, filt: PathFilter) -> dict[str, Stat]:
    """``{relative path: (mtime_ns, size, mode)}`` of the regular files and
    symlinks under ``root`` that ``filt`` accepts. Symlinks are not followed;
    other file types are ignored; a missing root is an empty tree.
    """
    out: dict[str, Stat] = {}
    literal = filt._ex_literal
    name_match = filt._ex_name.fullmatch if filt._ex_name is not None else None
    path_match = filt._ex_path.fullmatch if filt._ex_path is not None else None
    include = filt.includes_file if filt.has_includes else None
    scandir = os.scandir
    stack = [(root, "")]
    pop, push = stack.pop, stack.append
    while stack:
        top, prefix = pop()
        try:
            it = scandir(top)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        with it:
            for entry in it:
                name = entry.name
                if name in literal or (name_match is not None and name_match(name)):
                    continue
                rel = prefix + name
                if path_match is not None and path_match(rel):
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        push((entry.path, rel + "/"))
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished while we looked
                mode = st.st_mode
                fmt = mode & _S_IFMT
                if fmt != _S_IFREG and fmt != _S_IFLNK:
                    continue
                if include is not None and not include(rel, name):
                    continue
                out[rel] = (st.st_mtime_ns, st.st_size, mode)
    return out
