"""A local emulator of the managed Modal gateway (the seed system's tool
gateway), for tests only.

The wire contract is taken from the one public client of it,
NousResearch/hermes-agent ``tools/environments/managed_modal.py`` (create,
exec, poll, cancel, terminate; field names, the ``x-idempotency-key`` header,
the four final statuses) and ``tools/managed_tool_gateway.py`` (bearer tokens
that expire). Where that client does not show what the server does, the
emulator makes a choice and says so in a comment marked CHOICE; the README's
"Managed mode" section lists the same points as unknown.

stdlib ``ThreadingHTTPServer`` on 127.0.0.1. Each sandbox is a directory; each
exec a real local process (``sh -c command``, in its own session).

Knobs: ``latency`` (every answer that much later), ``token_ttl`` and
``issue_token()`` (tokens that expire), ``fail_next`` (an HTTP error),
``drop_next`` (do the work, then cut the connection without answering: a
proxy cutting a long request), ``delay_next`` (hold a request before doing
the work), ``end_sandbox`` (what a sandbox timeout does), ``image_lacks``
(programs missing from sandboxes created from then on).
"""

from __future__ import annotations

import codecs
import fnmatch
import select
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FINAL = ("completed", "failed", "cancelled", "timeout")


@dataclass
class _Fault:
    method: str
    path: str
    kind: str
    value: float
    remaining: int


class Exec:
    def __init__(
        self,
        exec_id: str,
        command: str,
        cwd: Path,
        env: dict[str, str],
        timeout_s: float | None,
        stdin: str | None = None,
    ) -> None:
        self.id = exec_id
        self.command = command
        self.stdin = stdin or ""
        self.lock = threading.Lock()
        self.out = bytearray()
        self.status = "running"  # CHOICE: the non-final status's name is not public
        self.returncode: int | None = None
        self.cancelled = False
        self.timed_out = False
        self.proc = subprocess.Popen(
            ["sh", "-c", command],
            cwd=cwd,
            env=env,
            # hermes-agent sends stdin as the exec's "stdinData" (modal_utils: stdin mode "payload").
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # CHOICE: one merged "output" string
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        if stdin is not None:
            threading.Thread(target=self._feed, args=(stdin.encode("utf-8", "replace"),), daemon=True).start()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._reap, args=(timeout_s,), daemon=True).start()

    def _feed(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()  # CHOICE: stdinData is followed by EOF
        except (BrokenPipeError, OSError):
            pass

    def _read(self) -> None:
        fd = self._fd
        while True:
            data = os.read(fd, 65536)
            if not data:
                break
            with self.lock:
                self.out += data
        self.proc.stdout.close()

    def _reap(self, timeout_s: float | None) -> None:
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
            rc = self.proc.wait()
        # CHOICE: like Modal's own exec wait, the exec ends when its process exits,
        # even while a background child holds the output open; what the pipe
        # still holds is taken for a short moment.
        self._reader.join(0.1)
        # What the pipe already holds is the exec's too (a loaded machine may not
        # have scheduled the reader yet); a child that holds it open silently is not waited for.
        until = time.monotonic() + 2.0
        while self._reader.is_alive() and time.monotonic() < until:
            try:
                ready, _, _ = select.select([self._fd], [], [], 0)
            except (OSError, ValueError):
                break
            if not ready:
                break
            time.sleep(0.01)
        with self.lock:
            self.returncode = 128 - rc if rc < 0 else rc
            if self.timed_out:
                self.status = "timeout"
            elif self.cancelled:
                self.status = "cancelled"
            else:
                self.status = "completed" if rc == 0 else "failed"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def cancel(self) -> None:
        with self.lock:
            if self.status != "running":
                return
            self.cancelled = True
        self.kill()

    def view(self) -> dict[str, Any]:
        with self.lock:
            # CHOICE: a running exec's poll carries the output so far (the public
            # client reads output only from a final answer).
            final = self.status in FINAL
            # JSON carries text: bytes that are not UTF-8 become U+FFFD, and a
            # running exec's output stops before a character split by a read.
            text = codecs.getincrementaldecoder("utf-8")("replace").decode(bytes(self.out), final=final)
            body: dict[str, Any] = {"execId": self.id, "status": self.status, "output": text}
            if final:
                body["returncode"] = self.returncode
            return body


@dataclass
class Sandbox:
    id: str
    root: Path
    cwd: str
    body: dict[str, Any]
    path: str | None = None
    execs: dict[str, Exec] = field(default_factory=dict)
    ended: bool = False
    terminated_with_snapshot: bool | None = None
    deadline: float | None = None
    last_active: float = field(default_factory=time.monotonic)

    def host_cwd(self, cwd: str) -> Path:
        # The sandbox's cwd maps onto its directory; other absolute paths are this host's.
        if cwd == self.cwd or not cwd:
            return self.root
        if cwd.startswith(self.cwd.rstrip("/") + "/"):
            return self.root / cwd[len(self.cwd.rstrip("/")) + 1 :]
        return Path(cwd)


class GatewayEmulator:
    """``with GatewayEmulator() as gw: ... gw.url, gw.token``."""

    def __init__(self, *, token: str = "gw-test-token", latency: float = 0.0) -> None:
        self.token = token
        self.latency = latency
        self.token_ttl: float | None = None
        self.image_lacks: set[str] = set()
        self.base_dir = Path(tempfile.mkdtemp(prefix="modal-gateway-emulator-"))
        self.sandboxes: dict[str, Sandbox] = {}
        self.snapshots: dict[str, Path] = {}  # logicalKey -> tar
        self.calls: list[tuple[str, str, dict[str, str]]] = []  # (method, path, selected headers)
        self.bodies: list[tuple[str, str, Any]] = []
        self.errors: list[str] = []
        self.refused = 0  # requests answered 401
        self._tokens: dict[str, float | None] = {token: None}
        self._faults: list[_Fault] = []
        self._idem: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

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
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        for sb in list(self.sandboxes.values()):
            self._end(sb)
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- knobs ---------------------------------------------------------------------
    def issue_token(self, ttl: float | None) -> str:
        """A new valid token, expiring ``ttl`` seconds from now (None: never)."""
        token = f"gw-{uuid.uuid4().hex}"
        with self._lock:
            self._tokens[token] = None if ttl is None else time.time() + ttl
        return token

    def revoke(self, token: str) -> None:
        with self._lock:
            self._tokens.pop(token, None)

    def fail_next(self, method: str, path: str, status: int, count: int = 1) -> None:
        self._faults.append(_Fault(method, path, "status", status, count))

    def drop_next(self, method: str, path: str, count: int = 1) -> None:
        self._faults.append(_Fault(method, path, "drop", 0, count))

    def delay_next(self, method: str, path: str, seconds: float, count: int = 1) -> None:
        self._faults.append(_Fault(method, path, "delay", seconds, count))

    def end_sandbox(self, sandbox_id: str) -> None:
        """What a sandbox timeout does: the sandbox is gone, later calls about it get 404."""
        self._end(self.sandboxes[sandbox_id])

    def count(self, method: str, pattern: str) -> int:
        return sum(1 for m, p, _ in self.calls if m == method and fnmatch.fnmatch(p, pattern))

    def execs_of(self, command_part: str) -> list[Exec]:
        # The command is in the exec's command or (the core's private script) in its stdinData.
        return [
            e
            for sb in self.sandboxes.values()
            for e in sb.execs.values()
            if command_part in e.command or command_part in e.stdin
        ]

    # -- internals -------------------------------------------------------------------
    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.method == method and fnmatch.fnmatch(path, f.path):
                    f.remaining -= 1
                    if f.remaining <= 0:
                        self._faults.remove(f)
                    return f
        return None

    def _token_ok(self, header: str) -> bool:
        if not header.startswith("Bearer "):
            return False
        with self._lock:
            if header[7:] not in self._tokens:
                return False
            exp = self._tokens[header[7:]]
        return exp is None or time.time() < exp

    def _watch(self) -> None:
        # Sandbox timeoutMs and idleTimeoutMs: CHOICE of what "idle" means (no
        # running exec), following Modal's own idle_timeout.
        while not self._stop.wait(0.1):
            now = time.monotonic()
            for sb in list(self.sandboxes.values()):
                if sb.ended:
                    continue
                busy = any(e.status == "running" for e in sb.execs.values())
                if busy:
                    sb.last_active = now
                idle = sb.body.get("idleTimeoutMs")
                if (sb.deadline is not None and now >= sb.deadline) or (
                    isinstance(idle, int) and not busy and now - sb.last_active >= idle / 1000
                ):
                    self._end(sb)

    def _end(self, sb: Sandbox) -> None:
        sb.ended = True
        for e in sb.execs.values():
            e.kill()

    def _bin_without(self, where: Path) -> str:
        where.mkdir(parents=True, exist_ok=True)
        for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                target, link = os.path.join(d, name), where / name
                if name in self.image_lacks or link.exists() or not os.access(target, os.X_OK):
                    continue
                link.symlink_to(target)
        return str(where)

    # -- the API -----------------------------------------------------------------------
    def create(self, body: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any]]:
        for name, kind in (("image", str), ("cwd", str), ("timeoutMs", int), ("logicalKey", str)):
            if not isinstance(body.get(name), kind):
                return 400, {"error": f"{name} is required ({kind.__name__})"}
        with self._lock:
            if key is not None and key in self._idem:
                return 200, self._idem[key]  # CHOICE: a replay answers as the first time
        sid = f"sb-{uuid.uuid4().hex[:12]}"
        root = self.base_dir / "sandboxes" / sid
        root.mkdir(parents=True)
        snap = self.snapshots.get(body["logicalKey"])
        if body.get("persistentFilesystem") and snap is not None:
            # CHOICE: a persistent sandbox of a logicalKey starts from the snapshot
            # its last terminate({snapshotBeforeTerminate: true}) took.
            with tarfile.open(snap) as tar:
                tar.extractall(root, filter="tar")
        sb = Sandbox(sid, root, body["cwd"], dict(body), deadline=time.monotonic() + body["timeoutMs"] / 1000)
        if self.image_lacks:
            sb.path = self._bin_without(self.base_dir / "bins" / sid)
        self.sandboxes[sid] = sb
        answer = {"id": sid}
        if key is not None:
            with self._lock:
                self._idem[key] = answer
        return 200, answer

    def _sandbox(self, sid: str) -> Sandbox | None:
        sb = self.sandboxes.get(sid)
        return None if sb is None or sb.ended else sb

    def start_exec(self, sid: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        sb = self._sandbox(sid)
        if sb is None:
            return 404, {"error": f"sandbox {sid} not found"}  # CHOICE: status of an ended sandbox
        exec_id = body.get("execId")
        if not isinstance(exec_id, str) or not isinstance(body.get("command"), str):
            return 400, {"error": "execId and command are required"}
        existing = sb.execs.get(exec_id)
        if existing is not None:
            return 200, existing.view()  # CHOICE: the execId makes a retried start idempotent
        env = {
            "PATH": sb.path or os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(sb.root),
            "LANG": "C.UTF-8",
        }
        timeout_ms = body.get("timeoutMs")
        cwd = sb.host_cwd(str(body.get("cwd") or sb.cwd))
        if not cwd.is_dir():
            return 400, {"error": f"cwd {body.get('cwd')!r} does not exist"}  # CHOICE
        stdin = body.get("stdinData")
        ex = Exec(
            exec_id,
            body["command"],
            cwd,
            env,
            timeout_ms / 1000 if isinstance(timeout_ms, int) else None,
            stdin if isinstance(stdin, str) else None,
        )
        sb.execs[exec_id] = ex
        sb.last_active = time.monotonic()
        # CHOICE: a start answers at once, or with the final state when the
        # command ends within 50 ms (the public client handles both).
        deadline = time.monotonic() + 0.05
        while ex.status == "running" and time.monotonic() < deadline:
            time.sleep(0.005)
        return 200, ex.view()

    def poll(self, sid: str, eid: str) -> tuple[int, dict[str, Any]]:
        sb = self.sandboxes.get(sid)
        ex = sb.execs.get(eid) if sb is not None else None
        if ex is None:
            return 404, {"error": f"exec {eid} not found"}
        return 200, ex.view()

    def cancel(self, sid: str, eid: str) -> tuple[int, dict[str, Any]]:
        sb = self.sandboxes.get(sid)
        ex = sb.execs.get(eid) if sb is not None else None
        if ex is None:
            return 404, {"error": f"exec {eid} not found"}
        ex.cancel()
        return 200, {"execId": eid, "status": ex.view()["status"]}

    def terminate(self, sid: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        sb = self.sandboxes.get(sid)
        if sb is None:
            return 404, {"error": f"sandbox {sid} not found"}
        if sb.ended:
            return 200, {"id": sid, "status": "terminated"}  # CHOICE: terminate is idempotent
        snapshot = bool(body.get("snapshotBeforeTerminate"))
        sb.terminated_with_snapshot = snapshot
        if snapshot and sb.body.get("persistentFilesystem"):
            tar_path = self.base_dir / f"snap-{uuid.uuid4().hex[:8]}.tar"
            with tarfile.open(tar_path, "w") as tar:
                tar.add(sb.root, arcname=".")
            self.snapshots[sb.body["logicalKey"]] = tar_path
        self._end(sb)
        return 200, {"id": sid, "status": "terminated"}


class _Handler(BaseHTTPRequestHandler):
    gateway: GatewayEmulator
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        gw = self.gateway
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        key = self.headers.get("x-idempotency-key")
        with gw._lock:
            gw.calls.append((method, path, {"x-idempotency-key": key} if key else {}))
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            self._send(400, {"error": "body is not JSON"})
            return
        gw.bodies.append((method, path, body))
        if gw.latency:
            time.sleep(gw.latency)
        if not gw._token_ok(self.headers.get("Authorization", "")):
            with gw._lock:
                gw.refused += 1
            self._send(401, {"error": "invalid or expired token"})
            return
        fault = gw._take_fault(method, path)
        if fault is not None and fault.kind == "status":
            self._send(int(fault.value), {"error": f"injected {int(fault.value)}"})
            return
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.value)
        try:
            status, answer = self._route(method, path, body, key)
        except Exception as exc:  # an emulator bug: visible to the tests
            gw.errors.append(f"{method} {path}: {exc!r}")
            self._send(500, {"error": repr(exc)})
            return
        if fault is not None and fault.kind == "drop":
            self.close_connection = True
            self.connection.close()
            return
        self._send(status, answer)

    def _route(self, method: str, path: str, body: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any]]:
        gw = self.gateway
        parts = path.strip("/").split("/")
        if parts[:2] != ["v1", "sandboxes"]:
            return 404, {"error": "no such route"}
        rest = parts[2:]
        if method == "POST" and not rest:
            return gw.create(body, key)
        if method == "POST" and len(rest) == 2 and rest[1] == "execs":
            return gw.start_exec(rest[0], body)
        if method == "GET" and len(rest) == 3 and rest[1] == "execs":
            return gw.poll(rest[0], rest[2])
        if method == "POST" and len(rest) == 4 and rest[1] == "execs" and rest[3] == "cancel":
            return gw.cancel(rest[0], rest[2])
        if method == "POST" and len(rest) == 2 and rest[1] == "terminate":
            return gw.terminate(rest[0], body)
        return 404, {"error": "no such route"}

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
