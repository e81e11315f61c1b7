"""The client-side records of named sessions: one JSON file per name, 0600.

``$XDG_STATE_HOME/hermes-env/sessions/NAME.json`` says where the session
lives (backend, non-secret options, target, private directory, server pid);
``NAME.state.json`` holds its last checkpoint, to restore a lost target.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .session import SessionState

__all__ = ["SessionRecord", "SessionStore", "UnknownSessionError", "state_from_json", "state_to_json"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Options whose value may be a secret: never written to a record (pass them again when attaching).
_SECRET_RE = re.compile(r"pass|secret|token|credential|api_key|^env$", re.IGNORECASE)


class UnknownSessionError(UsageError, LookupError):
    """No named session of that name."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise UsageError(
            f"invalid session name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def public_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options a record may keep: JSON values whose name does not look like a secret."""
    kept: dict[str, Any] = {}
    for key, value in options.items():
        if _SECRET_RE.search(key):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[key] = value
    return kept


@dataclasses.dataclass
class SessionRecord:
    """Where one named session lives."""

    name: str
    backend: str
    options: dict[str, Any]
    task_id: str
    private_dir: str
    target: str = ""
    server_pid: int = 0
    created: float = dataclasses.field(default_factory=time.time)
    last_used: float = dataclasses.field(default_factory=time.time)
    idle_timeout: float | None = None
    option_strings: dict[str, str] = dataclasses.field(default_factory=dict)  # as typed (-o KEY=VALUE)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class SessionStore:
    """The records of this user's named sessions."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        if root is None:
            base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
            root = os.path.join(base, "hermes-env", "sessions")
        self.root = Path(root)

    def _path(self, name: str, suffix: str = ".json") -> Path:
        return self.root / (check_name(name) + suffix)

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name[:-5] for p in self.root.glob("*.json") if not p.name.endswith(".state.json"))

    def get(self, name: str) -> SessionRecord | None:
        try:
            data = json.loads(self._path(name).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise UsageError(f"session {name!r}: its record {self._path(name)} is unreadable: {exc}") from exc
        return SessionRecord.from_json(data)

    def require(self, name: str) -> SessionRecord:
        record = self.get(name)
        if record is None:
            have = self.names()
            raise UnknownSessionError(
                f"no session named {name!r}; "
                + (f"the sessions are: {', '.join(have)}" if have else "there are no sessions (hermes-env sessions)")
            )
        return record

    def put(self, record: SessionRecord) -> None:
        self._write(self._path(record.name), json.dumps(dataclasses.asdict(record), indent=1))

    def put_state(self, name: str, baseline: SessionState | None, state: SessionState | None) -> None:
        data = {"saved": time.time(), "baseline": state_to_json(baseline), "state": state_to_json(state)}
        self._write(self._path(name, ".state.json"), json.dumps(data))

    def get_state(self, name: str) -> tuple[SessionState | None, SessionState | None, float | None, int]:
        """(baseline, checkpoint, when saved, size in bytes); Nones when there is none."""
        path = self._path(name, ".state.json")
        try:
            text = path.read_text()
            data = json.loads(text)
            return state_from_json(data.get("baseline")), state_from_json(data.get("state")), data.get("saved"), len(text)
        except (OSError, ValueError, TypeError):
            return None, None, None, 0

    def remove(self, name: str) -> None:
        for suffix in (".json", ".state.json"):
            try:
                self._path(name, suffix).unlink()
            except FileNotFoundError:
                pass

    def _write(self, path: Path, text: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)


def state_to_json(state: SessionState | None) -> dict[str, Any] | None:
    if state is None:
        return None
    out: dict[str, Any] = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        out[f.name] = sorted(value) if isinstance(value, frozenset) else value
    loaded: dict[str, Any] = json.loads(json.dumps(out))
    return loaded


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def state_from_json(data: dict[str, Any] | None) -> SessionState | None:
    if not data:
        return None
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(SessionState):
        if f.name not in data:
            continue
        value = data[f.name]
        if "frozenset" in str(f.type):
            value = frozenset(value)
        elif isinstance(value, list):
            value = _tuples(value)
        kwargs[f.name] = value
    return SessionState(**kwargs)
