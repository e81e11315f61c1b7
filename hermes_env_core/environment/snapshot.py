"""Snapshots of a session (its shell state and its target's files), stored, listed and restored.

A snapshot is a directory under ``$XDG_STATE_HOME/hermes-env/snapshots/NAME``
(0700): ``manifest.json`` (what it is, and the SHA-256 of every part),
``manifest.sha256``, ``state.json`` (the session state, secrets left out) and
the files part (archives, for docker a committed image named in the manifest, or
the parts a backend's own ``snapshot_files`` wrote, such as apptainer's overlay).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import HermesEnvError, UsageError
from .session import SessionState
from .shellscript import DECLARED_WORD, ansi_c_quote, declared_value

if TYPE_CHECKING:
    pass

__all__ = [
    "CorruptSnapshotError",
    "FilesRef",
    "Snapshot",
    "SnapshotNotFoundError",
    "filter_state",
    "list_snapshots",
    "load_snapshot",
    "remove_snapshot",
    "snapshots_dir",
    "state_from_json",
    "state_to_json",
]

FORMAT = 1
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}\Z")
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
STATE = "state.json"


class SnapshotNotFoundError(UsageError, LookupError):
    """No snapshot of that name (the message lists those that exist)."""


class CorruptSnapshotError(HermesEnvError):
    """A snapshot whose parts do not match its manifest, or that cannot be read: refused whole."""


@dataclass(frozen=True)
class FilesRef:
    """Where a snapshot's files are.

    ``kind``: ``archive`` (one tar per root in ``parts``, ``roots`` the paths they
    came from), ``image`` (a docker image: ``ref`` its tag, ``digest`` its id),
    ``none`` (a state-only snapshot), or a backend's own kind (``snapshot_files``:
    its ``parts`` are files in the snapshot, checked by SHA-256 like archives; none
    when the files are kept elsewhere and ``ref`` names them, as a Modal image).
    """

    kind: str
    roots: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()
    ref: str | None = None
    digest: str | None = None
    size: int = 0


@dataclass(frozen=True)
class Snapshot:
    """One snapshot: a frozen record of a session's state and where its files are."""

    name: str
    backend: str
    created: float  # seconds since the epoch
    state_text: str  # ``state_to_json`` of the state, secrets left out
    files: FilesRef
    options: Mapping[str, Any] = field(default_factory=dict)  # the backend options to recreate the target with
    omitted: tuple[str, ...] = ()  # variables left out as secrets (names only)
    path: str | None = None  # its directory (None: a temporary one, for a fork)

    @property
    def state(self) -> SessionState:
        return state_from_json(self.state_text)

    def part(self, name: str) -> Path:
        if self.path is None:
            raise CorruptSnapshotError(f"snapshot {self.name!r} has no stored parts")
        return Path(self.path) / name


# -- where they live ---------------------------------------------------------------------
def snapshots_dir(create: bool = True) -> Path:
    """``$XDG_STATE_HOME/hermes-env/snapshots`` (default ``~/.local/state/...``), 0700."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    path = Path(base) / "hermes-env" / "snapshots"
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)
    return path


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UsageError(
            f"snapshot name {name!r} is not valid: 1 to 100 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def new_name() -> str:
    return time.strftime("snap-%Y%m%d-%H%M%S-", time.gmtime()) + os.urandom(3).hex()


def snapshot_names() -> list[str]:
    root = snapshots_dir(create=False)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and NAME_RE.match(p.name))


def _not_found(name: str) -> SnapshotNotFoundError:
    names = snapshot_names()
    have = ", ".join(names) if names else "none"
    return SnapshotNotFoundError(
        f"no snapshot named {name!r} in {snapshots_dir(create=False)} (snapshots that exist: {have}); "
        "hermes-env snapshots lists them"
    )


# -- the state as text ---------------------------------------------------------------------
_SET_FIELDS = ("shellopts", "bashopts", "all_seto", "all_shopt")


def state_to_json(state: SessionState) -> str:
    """A ``SessionState`` as JSON text (deterministic; lone surrogates escaped)."""
    data: dict[str, Any] = {}
    for f in dataclasses.fields(SessionState):
        value = getattr(state, f.name)
        if isinstance(value, frozenset):
            value = sorted(value)
        elif isinstance(value, tuple):
            value = [list(v) if isinstance(v, tuple) else v for v in value]
        data[f.name] = value
    return json.dumps(data, sort_keys=True, ensure_ascii=True, indent=1)


def state_from_json(text: str) -> SessionState:
    """The ``SessionState`` of ``state_to_json``; ``CorruptSnapshotError`` if it is not one."""
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise TypeError("not an object")
        known = {f.name for f in dataclasses.fields(SessionState)}
        unknown = set(data) - known
        if unknown:
            raise TypeError(f"unknown fields {sorted(unknown)}")
        out: dict[str, Any] = {}
        for name, value in data.items():
            if name in _SET_FIELDS:
                value = frozenset(_strs(value, name))
            elif name == "variables":
                if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                    raise TypeError("variables must map names to declare lines")
            elif name == "traps":
                value = tuple((str(a), str(b)) for a, b in value)
            elif name == "ulimits":
                value = tuple((str(a), str(b), str(c)) for a, b, c in value)
            elif name == "fds":
                value = tuple(int(v) for v in value)
            elif name == "cpu_times":
                value = None if value is None else (float(value[0]), float(value[1]))
            elif name in ("functions", "aliases", "hashes") and not isinstance(value, str):
                raise TypeError(f"{name} must be text")
            out[name] = value
        return SessionState(**out)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise CorruptSnapshotError(f"the snapshot's session state cannot be read: {exc}") from exc


def _strs(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of names")
    return value


# -- secrets ---------------------------------------------------------------------------------
def _secret_names(variables: Mapping[str, str], passthrough: tuple[str, ...], blocked: tuple[str, ...]) -> set[str]:
    from ..backends.local import filter_environment

    kept = filter_environment(variables, passthrough=passthrough, extra_blocked=blocked)
    return {n for n in variables if n not in kept}


def filter_state(
    state: SessionState, *, passthrough: tuple[str, ...] = (), blocked: tuple[str, ...] = ()
) -> tuple[SessionState, tuple[str, ...]]:
    """``state`` without secret-looking variables (names as ``filter_environment`` judges them,
    or a value holding a URL with a password) and without ``$_`` when it shows one; and their names."""
    from ..backends.local import carries_url_password

    secret = _secret_names(state.variables, passthrough, blocked)
    variables = {n: line for n, line in state.variables.items() if n not in secret}
    last = state.last_arg
    if last is not None and (
        carries_url_password(last) or any(_value_text(state.variables[n]) in last for n in secret if _value_text(state.variables[n]))
        or any(re.search(rf"(^|[^\w]){re.escape(n)}=", last) for n in secret)
    ):
        last = None
    return dataclasses.replace(state, variables=variables, last_arg=last), tuple(sorted(secret))


def _value_text(line: str) -> str:
    """The quoted value of a ``declare`` line (what a secret looks like in other text)."""
    value = line.partition("=")[2]
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value


def restored_state(
    snap_state: SessionState,
    baseline: SessionState,
    *,
    cwd: str | None = None,
    passthrough: tuple[str, ...] = (),
    blocked: tuple[str, ...] = (),
    relocate: Callable[[str], str | None] | None = None,
) -> SessionState:
    """The state a new session starts with: the snapshot's, plus the new shell's own secret-looking
    variables (never captured, so never removed), in ``cwd`` when given; ``relocate`` maps a
    directory of the snapshot to where its files were restored (None: not restored)."""
    secret = _secret_names(baseline.variables, (), blocked)  # passthrough or not: never captured by default
    variables = dict(snap_state.variables)
    for name in secret:
        variables.setdefault(name, baseline.variables[name])
    out = dataclasses.replace(snap_state, variables=variables)
    if cwd is not None:
        out = dataclasses.replace(out, cwd=cwd)
    if relocate is not None:
        out = _relocated(out, relocate)
    return out


def _relocated(state: SessionState, relocate: Callable[[str], str | None]) -> SessionState:
    """OLDPWD and the directory stack moved with the files (paths outside them stay as they were)."""

    def one(m: re.Match[str]) -> str:
        new = relocate(declared_value(m))
        return m.group(0) if new is None else ansi_c_quote(new)

    variables = dict(state.variables)
    old = variables.get("OLDPWD")
    if old is not None:
        head, eq, value = old.partition("=")
        variables["OLDPWD"] = head + eq + DECLARED_WORD.sub(one, value, count=1)
    dirstack = DECLARED_WORD.sub(one, state.dirstack) if state.dirstack else state.dirstack
    return dataclasses.replace(state, variables=variables, dirstack=dirstack)


# -- storing and reading ----------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def new_workdir(name: str) -> Path:
    """A private directory to build a snapshot in, beside where it will be stored."""
    return Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=snapshots_dir()))


def store(snap: Snapshot, workdir: Path) -> Snapshot:
    """Write the state and the manifest into ``workdir`` (which holds the file parts) and move it
    to its place; raises if the name is taken."""
    (workdir / STATE).write_text(snap.state_text, encoding="ascii")
    parts = {STATE: {"sha256": _sha256(workdir / STATE), "size": (workdir / STATE).stat().st_size}}
    for part in snap.files.parts:
        p = workdir / part
        parts[part] = {"sha256": _sha256(p), "size": p.stat().st_size}
    manifest = {
        "format": FORMAT,
        "name": snap.name,
        "backend": snap.backend,
        "created": snap.created,
        "files": dataclasses.asdict(snap.files),
        "options": dict(snap.options),
        "omitted": list(snap.omitted),
        "parts": parts,
    }
    text = json.dumps(manifest, sort_keys=True, indent=1).encode()
    (workdir / MANIFEST).write_bytes(text)
    (workdir / MANIFEST_SUM).write_text(hashlib.sha256(text).hexdigest() + "\n")
    final = snapshots_dir() / snap.name
    try:
        os.rename(workdir, final)  # fails when a (non-empty) snapshot of that name exists
    except OSError as exc:
        raise UsageError(
            f"a snapshot named {snap.name!r} already exists; remove it first (hermes-env snapshots rm {snap.name})"
        ) from exc
    return dataclasses.replace(snap, path=str(final))


def load_snapshot(name: str | Snapshot, *, verify_archives: bool = True) -> Snapshot:
    """The stored snapshot ``name`` (or the one a ``Snapshot`` was read from), every part checked;
    ``SnapshotNotFoundError`` or ``CorruptSnapshotError``. A fork's temporary snapshot is returned as is."""
    root = snapshots_dir(create=False)
    if isinstance(name, Snapshot):
        if name.path is None or not (Path(name.path) / MANIFEST_SUM).exists():
            return name
        root, name = Path(name.path).parent, name.name
    check_name(name)
    path = root / name
    if not path.is_dir():
        raise _not_found(name)
    where = f"snapshot {name!r} ({path})"
    try:
        text = (path / MANIFEST).read_bytes()
        want = (path / MANIFEST_SUM).read_text().strip()
    except OSError as exc:
        raise CorruptSnapshotError(f"{where} is incomplete: {exc.strerror}: {exc.filename}; refused") from exc
    if hashlib.sha256(text).hexdigest() != want:
        raise CorruptSnapshotError(f"{where}: its manifest does not match its checksum (edited or damaged); refused")
    try:
        m = json.loads(text)
        if m.get("format") != FORMAT:
            raise ValueError(f"format {m.get('format')!r}, this version reads {FORMAT}")
        if m["name"] != name:
            raise ValueError(f"it names itself {m['name']!r}")
        files = FilesRef(**{**m["files"], "roots": tuple(m["files"]["roots"]), "parts": tuple(m["files"]["parts"])})
        parts: dict[str, dict[str, Any]] = m["parts"]
        snap = Snapshot(
            name=name, backend=str(m["backend"]), created=float(m["created"]), state_text="", files=files,
            options=dict(m["options"]), omitted=tuple(m.get("omitted", ())), path=str(path),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptSnapshotError(f"{where}: its manifest cannot be read ({exc}); refused") from exc
    listed = set(parts) | {MANIFEST, MANIFEST_SUM}
    present = {p.name for p in path.iterdir()}
    if present != listed or STATE not in parts or not set(files.parts) <= set(parts):
        extra, missing = sorted(present - listed), sorted(listed - present)
        raise CorruptSnapshotError(f"{where}: parts do not match its manifest (missing {missing}, unlisted {extra}); refused")
    for part, info in parts.items():
        p = path / part
        size = p.stat().st_size
        if size != info.get("size") or _sha256(p) != info.get("sha256"):
            raise CorruptSnapshotError(
                f"{where}: part {part} does not match its checksum ({size} bytes, {info.get('size')} recorded); refused"
            )
    state_text = (path / STATE).read_text(encoding="ascii", errors="strict")
    state_from_json(state_text)
    if verify_archives and files.kind == "archive":  # a backend's own kind checks its parts when it starts
        for part in files.parts:
            check_archive(path / part, where)
    return dataclasses.replace(snap, state_text=state_text)


def check_archive(path: Path, where: str) -> list[tarfile.TarInfo]:
    """Read the whole archive; refuse it if truncated or if a member could land outside its root."""
    try:
        with tarfile.open(path, "r:*") as tar:
            members = []
            links: set[str] = set()
            for m in tar:
                name = _norm(m.name)
                if name is None:
                    raise CorruptSnapshotError(f"{where}: {path.name} holds an unsafe path {m.name!r}; refused")
                if m.isdev():
                    raise CorruptSnapshotError(f"{where}: {path.name} holds a device file {m.name!r}; refused")
                if any(name == link or name.startswith(link + "/") for link in links):
                    raise CorruptSnapshotError(f"{where}: {path.name} writes through a symbolic link ({m.name!r}); refused")
                if m.islnk() and _norm(m.linkname) is None:
                    raise CorruptSnapshotError(f"{where}: {path.name} holds a hard link out of it ({m.linkname!r}); refused")
                if m.issym():
                    links.add(name)
                if m.isfile():
                    f = tar.extractfile(m)
                    assert f is not None
                    while f.read(1 << 20):
                        pass
                members.append(m)
            return members
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise CorruptSnapshotError(f"{where}: archive {path.name} is damaged or truncated ({exc}); refused") from exc


def _norm(name: str) -> str | None:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        return None
    return "/".join(parts)


def list_snapshots() -> list[tuple[str, Snapshot | None, str]]:
    """Every stored snapshot: (name, the record or None, "" or why it is refused). Archives are not re-read."""
    out: list[tuple[str, Snapshot | None, str]] = []
    for name in snapshot_names():
        try:
            out.append((name, load_snapshot(name, verify_archives=False), ""))
        except HermesEnvError as exc:
            out.append((name, None, str(exc)))
    return out


def remove_snapshot(name: str) -> Snapshot | None:
    """Delete a stored snapshot (and its docker image); returns its record when it could be read."""
    check_name(name)
    path = snapshots_dir(create=False) / name
    if not path.is_dir():
        raise _not_found(name)
    try:
        snap: Snapshot | None = load_snapshot(name, verify_archives=False)
    except CorruptSnapshotError:
        snap = _image_of_damaged(path)
    if snap is not None and snap.files.kind == "image":
        from .snapshot_files import remove_image

        remove_image(snap)
    shutil.rmtree(path)
    return snap


def _image_of_damaged(path: Path) -> Snapshot | None:
    """What a refused snapshot's manifest says of its docker image, if it still says it (for ``rm``)."""
    try:
        m = json.loads((path / MANIFEST).read_text())
        files = m["files"]
        if files.get("kind") != "image" or not str(files.get("ref", "")).startswith("hermes-env-snapshot:"):
            return None
        return Snapshot(
            name=path.name, backend="docker", created=0.0, state_text="",
            files=FilesRef("image", ref=files["ref"]), options={"docker_host": m.get("options", {}).get("docker_host")},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
