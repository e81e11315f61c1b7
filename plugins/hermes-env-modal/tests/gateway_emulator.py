"""A local emulator of the managed gateway's REST API (v1), for tests only.

stdlib ``ThreadingHTTPServer`` on 127.0.0.1. Each sandbox is a directory and a
real ``hermes_env_core`` local environment (real bash processes, real session
state); snapshots are tar files of the directory. The API is the one
``hermes_env_modal.gateway`` documents: bearer auth, Idempotency-Key on
create/exec/terminate (a replay returns the first answer; the same key with a
different body is 409), long-polled output by byte offset.

Faults for tests: ``fail_next(method, path_glob, status)``, ``drop_next(...)``
(do the work, then close the connection without answering) and
``delay_next(..., seconds)`` (sleep before doing the work).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import shutil
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from hermes_env_core.backends.local import LocalEnvironment

_MAX_CHUNK = 4 * 1024 * 1024  # output bytes per poll answer
# The calls that take (and need) an Idempotency-Key: create, exec, terminate.
_IDEMPOTENT = re.compile(r"/v1/sandboxes(?:/[^/]+/(?:execs|terminate))?")


class _Exec:
    def __init__(self, exec_id: str) -> None:
        self.id = exec_id
        self.cond = threading.Condition()
        self.buf = bytearray()
        self.base = 0  # stream offset of buf[0]; what the client acknowledged is dropped
        self.done = False
        self.result: Any = None
        self.error: str | None = None
        self.cancel = threading.Event()
        self.thread: threading.Thread | None = None

    def feed(self, text: str) -> None:
        with self.cond:
            self.buf += text.encode("utf-8", "surrogatepass")
            self.cond.notify_all()

    def finish(self, result: Any = None, error: str | None = None) -> None:
        with self.cond:
            self.result, self.error, self.done = result, error, True
            self.cond.notify_all()

    def poll(self, offset: int, wait_s: float) -> dict[str, Any]:
        end = time.monotonic() + max(0.0, wait_s)
        with self.cond:
            if offset > self.base:  # acknowledged: never asked for again
                drop = min(offset - self.base, len(self.buf))
                del self.buf[:drop]
                self.base += drop
            while not self.done and self.base + len(self.buf) <= offset:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            start = max(offset, self.base)
            data = bytes(self.buf[start - self.base : start - self.base + _MAX_CHUNK])
            nxt = start + len(data)
            total = self.base + len(self.buf)
            state: dict[str, Any] = {
                "exec_id": self.id,
                "status": "finished" if self.done else "running",
                "offset": start,
                "next_offset": nxt,
                "output_b64": base64.b64encode(data).decode("ascii"),
                "done": self.done and nxt >= total,
                "exit_code": None,
                "timed_out": False,
                "cancelled": False,
                "cwd": None,
                "notes": [],
            }
            if self.done:
                r = self.result
                if r is not None:
                    state.update(
                        exit_code=r.exit_code, timed_out=r.timed_out, cancelled=r.interrupted,
                        cwd=r.cwd, notes=list(r.notes),
                    )
                else:
                    state.update(exit_code=None, notes=[f"gateway: {self.error}"])
            return state


@dataclass
class Sandbox:
    id: str
    task_id: str
    root: Path
    env: LocalEnvironment
    image_id: str | None
    request: dict[str, Any]
    execs: dict[str, _Exec] = field(default_factory=dict)
    ended: bool = False


@dataclass
class _Fault:
    method: str
    path: str
    kind: str  # "status", "drop", "delay"
    value: float
    remaining: int


class _ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class GatewayEmulator:
    """``with GatewayEmulator() as gw: ... gw.url, gw.token``."""

    def __init__(self, *, token: str = "gw-test-token") -> None:
        self.token = token
        self.base_dir = Path(tempfile.mkdtemp(prefix="modal-gateway-emulator-"))
        self.sandboxes: dict[str, Sandbox] = {}
        self.images: dict[str, Path] = {}
        self.calls: list[tuple[str, str, str | None]] = []  # (method, path, idempotency key)
        self.errors: list[str] = []
        self._faults: list[_Fault] = []
        self._idem: dict[str, tuple[str, int, dict[str, Any]]] = {}
        self._idem_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> GatewayEmulator:  # noqa: PYI034
        emu = self

        class Handler(_Handler):
            gateway = emu

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="modal-gateway-emu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        for sb in list(self.sandboxes.values()):
            self._end(sb)
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- test controls --------------------------------------------------------------
    def fail_next(self, method: str, path: str, status: int, count: int = 1) -> None:
        self._faults.append(_Fault(method, path, "status", status, count))

    def drop_next(self, method: str, path: str, count: int = 1) -> None:
        self._faults.append(_Fault(method, path, "drop", 0, count))

    def delay_next(self, method: str, path: str, seconds: float, count: int = 1) -> None:
        self._faults.append(_Fault(method, path, "delay", seconds, count))

    def end_sandbox(self, sandbox_id: str) -> None:
        """What a sandbox timeout does: the sandbox is gone, later calls get 404."""
        self._end(self.sandboxes[sandbox_id])

    def forget_image(self, image_id: str) -> None:
        path = self.images.pop(image_id)
        path.unlink(missing_ok=True)

    def count(self, method: str, pattern: str) -> int:
        return sum(1 for m, p, _ in self.calls if m == method and fnmatch.fnmatch(p, pattern))

    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.method == method and fnmatch.fnmatch(path, f.path):
                    f.remaining -= 1
                    if f.remaining <= 0:
                        self._faults.remove(f)
                    return f
        return None

    # -- the API ------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict[str, str], body: dict[str, Any]) -> tuple[int, dict]:
        m = re.fullmatch(r"/v1/sandboxes", path)
        if m and method == "POST":
            return 201, self._create(body)
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)/execs", path)
        if m and method == "POST":
            return 201, self._start(self._sandbox(m.group(1)), body)
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)/execs/([^/]+)", path)
        if m and method == "GET":
            ex = self._exec(m.group(1), m.group(2))
            return 200, ex.poll(int(query.get("offset", "0")), min(float(query.get("wait_s", "0")), 30.0))
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)/execs/([^/]+)/cancel", path)
        if m and method == "POST":
            ex = self._exec(m.group(1), m.group(2))
            ex.cancel.set()
            return 202, {"status": "finished" if ex.done else "cancelling"}
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)/terminate", path)
        if m and method == "POST":
            return 200, self._terminate(self._sandbox(m.group(1)), bool(body.get("snapshot")))
        raise _ApiError(404, "no_route", f"no route {method} {path}")

    def _sandbox(self, sandbox_id: str) -> Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise _ApiError(404, "sandbox_not_found", f"sandbox {sandbox_id} not found")
        if sb.ended:
            raise _ApiError(410, "sandbox_ended", f"sandbox {sandbox_id} has ended")
        return sb

    def _exec(self, sandbox_id: str, exec_id: str) -> _Exec:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise _ApiError(404, "sandbox_not_found", f"sandbox {sandbox_id} not found")
        ex = sb.execs.get(exec_id)
        if ex is None:
            raise _ApiError(404, "exec_not_found", f"exec {exec_id} not found")
        return ex

    def _create(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = "sb-gw-" + uuid.uuid4().hex[:12]
        root = self.base_dir / "sandboxes" / sid
        root.mkdir(parents=True)
        restored_from = restore_error = None
        image = body.get("restore_image_id")
        if image:
            tar = self.images.get(image)
            if tar is None:
                restore_error = f"image {image} not found"
            else:
                with tarfile.open(tar) as tf:
                    tf.extractall(root, filter="tar")
                restored_from = image
        env = LocalEnvironment(
            task_id=sid,
            cwd=str(root),
            env={**(body.get("env") or {}), "HOME": str(root)},
            session_exclude_prefixes=tuple(body.get("session_exclude_prefixes") or ("HERMES_SESSION_",)),
        )
        sb = Sandbox(sid, str(body.get("task_id") or ""), root, env, restored_from, body)
        self.sandboxes[sid] = sb
        return {"sandbox_id": sid, "restored_from": restored_from, "restore_error": restore_error, "cwd": str(root)}

    def _start(self, sb: Sandbox, body: dict[str, Any]) -> dict[str, Any]:
        command = body.get("command")
        if not isinstance(command, str):
            raise _ApiError(400, "invalid_request", "command must be a string")
        stdin = base64.b64decode(body["stdin_b64"]) if body.get("stdin_b64") is not None else None
        ex = _Exec("ex-" + uuid.uuid4().hex[:12])
        sb.execs[ex.id] = ex

        def run() -> None:
            try:
                r = sb.env.execute(
                    command, cwd=body.get("cwd"), timeout=body.get("timeout_s"), stdin=stdin,
                    cancel=ex.cancel, on_output=ex.feed,
                )
            except Exception as exc:  # noqa: BLE001 - the emulator reports it
                self.errors.append(f"exec {ex.id}: {exc!r}")
                ex.finish(error=repr(exc))
            else:
                ex.finish(result=r)

        ex.thread = threading.Thread(target=run, name=f"gw-exec-{ex.id}", daemon=True)
        ex.thread.start()
        return ex.poll(0, min(float(body.get("wait_s") or 0), 30.0))

    def _terminate(self, sb: Sandbox, snapshot: bool) -> dict[str, Any]:
        image_id = None
        if snapshot:
            image_id = "im-gw-" + uuid.uuid4().hex[:12]
            path = self.base_dir / "images" / f"{image_id}.tar"
            path.parent.mkdir(exist_ok=True)
            with tarfile.open(path, "w") as tf:
                tf.add(sb.root, arcname=".")
            self.images[image_id] = path
        self._end(sb)
        return {"sandbox_id": sb.id, "image_id": image_id, "snapshot_error": None}

    def _end(self, sb: Sandbox) -> None:
        if sb.ended:
            return
        sb.ended = True
        for ex in sb.execs.values():
            ex.cancel.set()
        for ex in sb.execs.values():
            if ex.thread is not None:
                ex.thread.join(15)
        sb.env.close()

    # -- idempotency ------------------------------------------------------------------
    def idempotent(self, key: str, fingerprint: str, work) -> tuple[int, dict[str, Any]]:
        with self._lock:
            lock = self._idem_locks.setdefault(key, threading.Lock())
        with lock:  # a duplicate in flight waits for the first one's answer
            seen = self._idem.get(key)
            if seen is not None:
                if seen[0] != fingerprint:
                    raise _ApiError(409, "idempotency_conflict", f"Idempotency-Key {key} was used for another request")
                return seen[1], seen[2]
            status, payload = work()
            self._idem[key] = (fingerprint, status, payload)
            return status, payload


class _Handler(BaseHTTPRequestHandler):
    gateway: GatewayEmulator
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        gw = self.gateway
        url = urlsplit(self.path)
        path = url.path
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        key = self.headers.get("Idempotency-Key")
        gw.calls.append((method, path, key))
        fault = gw._take_fault(method, path)
        if self.headers.get("Authorization") != f"Bearer {gw.token}":
            return self._send(401, {"error": {"code": "unauthenticated", "message": "missing or wrong bearer token"}})
        if fault is not None and fault.kind == "status":
            return self._send(int(fault.value), {"error": {"code": "injected", "message": "emulator: injected"}})
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.value)
        try:
            body = json.loads(raw) if raw else {}
            if method == "POST" and _IDEMPOTENT.fullmatch(path):
                if not key:
                    raise _ApiError(400, "idempotency_key_required", "POST needs an Idempotency-Key header")
                fingerprint = hashlib.sha256(method.encode() + path.encode() + raw).hexdigest()
                status, payload = gw.idempotent(key, fingerprint, lambda: gw.handle(method, path, query, body))
            else:
                status, payload = gw.handle(method, path, query, body)
        except _ApiError as exc:
            status, payload = exc.status, {"error": {"code": exc.code, "message": exc.message}}
        except Exception as exc:  # noqa: BLE001 - an emulator bug: visible to the tests
            gw.errors.append(f"{method} {path}: {exc!r}")
            status, payload = 500, {"error": {"code": "internal", "message": repr(exc)}}
        if fault is not None and fault.kind == "drop":
            self.close_connection = True
            self.connection.shutdown(2)
            return None
        return self._send(status, payload)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status, HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
