"""The emulator's object store: Kubernetes-shaped JSON objects, selectors and Status bodies.

Shapes follow the API reference (kubernetes.io/docs/reference/kubernetes-api/):
every object has ``metadata.{name,namespace,uid,resourceVersion,creationTimestamp}``;
errors are ``Status`` objects (``kind: Status``, ``reason``, ``code``, ``details``),
as apimachinery's ``k8s.io/apimachinery/pkg/api/errors`` builds them.
"""

from __future__ import annotations

import copy
import datetime
import secrets
import threading
import uuid
from typing import Any

Obj = dict[str, Any]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str, *, kind: str | None = None, name: str | None = None) -> Obj:
    """A ``metav1.Status`` failure body."""
    details: Obj = {}
    if kind:
        details["kind"] = kind
    if name:
        details["name"] = name
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "details": details, "code": code,
    }


class ApiError(Exception):
    """Raised by handlers; becomes an HTTP response with a Status body."""

    def __init__(self, body: Obj) -> None:
        super().__init__(body["message"])
        self.body = body

    @property
    def code(self) -> int:
        return int(self.body["code"])


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(status(404, "NotFound", f'{resource} "{name}" not found', kind=resource, name=name))


def already_exists(resource: str, name: str) -> ApiError:
    return ApiError(status(409, "AlreadyExists", f'{resource} "{name}" already exists', kind=resource, name=name))


def invalid(resource: str, name: str, why: str) -> ApiError:
    return ApiError(status(422, "Invalid", f'{resource} "{name}" is invalid: {why}', kind=resource, name=name))


def _label_match(labels: dict[str, str], selector: str) -> bool:
    """``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a`` and ``a in (x,y)`` terms, comma-joined (all must hold)."""
    terms, depth, cur = [], 0, ""
    for ch in selector:  # split on commas outside parentheses
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    for term in (t.strip() for t in terms):
        if not term:
            continue
        if " in " in term or " notin " in term:
            key, op, rest = term.partition(" notin " if " notin " in term else " in ")
            values = {v.strip() for v in rest.strip().strip("()").split(",")}
            inside = labels.get(key.strip()) in values
            if inside != (op.strip() == "in"):
                return False
        elif "!=" in term:
            key, _, value = term.partition("!=")
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, _, value = term.replace("==", "=").partition("=")
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field(obj: Obj, path: str) -> Any:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def _field_match(obj: Obj, selector: str) -> bool:
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        neg = "!=" in term
        key, _, value = term.partition("!=" if neg else "=")
        actual = _field(obj, key.strip().lstrip("="))
        actual = "" if actual is None else str(actual)
        if (actual == value.strip().lstrip("=")) == neg:
            return False
    return True


class Store:
    """Objects by (resource plural, namespace, name); thread-safe; copies in and out."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._rv = 0

    def _bump(self, obj: Obj) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)

    def create(self, resource: str, namespace: str, obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        with self.lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
            name = meta.get("name") or ""
            if not name:
                raise invalid(resource, "", "metadata.name: Required value: name or generateName is required")
            key = (resource, namespace, name)
            if key in self._objects:
                raise already_exists(resource, name)
            if namespace:
                meta["namespace"] = namespace
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now()
            meta.setdefault("labels", {})
            self._bump(obj)
            self._objects[key] = obj
            return copy.deepcopy(obj)

    def get(self, resource: str, namespace: str, name: str) -> Obj:
        with self.lock:
            obj = self._objects.get((resource, namespace, name))
            if obj is None:
                raise not_found(resource, name)
            return copy.deepcopy(obj)

    def peek(self, resource: str, namespace: str, name: str) -> Obj | None:
        """The live object (no copy) for in-place updates under ``lock``."""
        return self._objects.get((resource, namespace, name))

    def update(self, resource: str, namespace: str, name: str, fn: Any) -> Obj | None:
        """Apply ``fn(obj)`` to the stored object in place; None when it is gone."""
        with self.lock:
            obj = self._objects.get((resource, namespace, name))
            if obj is None:
                return None
            fn(obj)
            self._bump(obj)
            return copy.deepcopy(obj)

    def remove(self, resource: str, namespace: str, name: str) -> Obj | None:
        with self.lock:
            return self._objects.pop((resource, namespace, name), None)

    def list(self, resource: str, namespace: str | None, labels: str = "", fields: str = "") -> list[Obj]:
        with self.lock:
            out = []
            for (res, ns, _), obj in list(self._objects.items()):
                if res != resource or (namespace is not None and ns != namespace):
                    continue
                if labels and not _label_match(obj["metadata"].get("labels") or {}, labels):
                    continue
                if fields and not _field_match(obj, fields):
                    continue
                out.append(copy.deepcopy(obj))
            return out

    @property
    def resource_version(self) -> str:
        return str(self._rv)
