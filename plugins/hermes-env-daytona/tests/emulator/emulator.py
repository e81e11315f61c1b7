"""``DaytonaEmulator``: the control plane and the toolbox on one 127.0.0.1 port.

    with DaytonaEmulator() as emu:
        daytona = Daytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key))

Layout of the port:  ``/api/...`` is the control plane (``emu.api_url``),
``/toolbox/{sandbox_id}/...`` the per-sandbox daemon (``emu.toolbox_url``, what
the Sandbox DTO's ``toolboxProxyUrl`` says), ``/api/socket.io/`` the SDK's event
gateway (see ``events.py``).
"""

from __future__ import annotations

import collections
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import parse_qs, urlsplit

from .control import ControlPlane
from .errors import SOURCE_API, HttpError
from .events import EventHub
from .ptys import PtyService
from .images import DEBIAN, DEFAULT_PROFILES, ImageProfile, profile_for
from .sandboxes import EmulatedSandbox
from .toolbox import Toolbox
from .wire import MAX_BODY_BYTES, Request, Response, Router, json_response

API_PREFIX = "/api"
TOOLBOX_PREFIX = "/toolbox"
SOCKETIO_PATH = f"{API_PREFIX}/socket.io"

VALID_STATES = {
    "creating", "restoring", "destroyed", "destroying", "started", "stopped", "starting", "stopping",
    "error", "build_failed", "pending_build", "building_snapshot", "unknown", "pulling_snapshot",
    "archived", "archiving", "resizing", "snapshotting", "forking", "pausing", "paused", "resuming",
}  # fmt: skip


@dataclass
class InjectedFailure:
    status: int
    method: str | None
    path: re.Pattern[str] | None
    remaining: int
    message: str
    code: str | None
    headers: dict[str, str]

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method != method:
            return False
        return self.path is None or bool(self.path.search(path))


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: str
    status: int


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, emu: DaytonaEmulator) -> None:
        self.emu = emu
        self.open_sockets: set[socket.socket] = set()
        self.sockets_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "DaytonaEmulator/1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in one write, and small writes are not held back
        # by Nagle waiting on the client's delayed ACK (a 40 ms stall per request).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.sockets_lock:
            self.server.open_sockets.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.server.sockets_lock:
                self.server.open_sockets.discard(self.connection)

    def log_message(self, format: str, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks, total = [], 0
            while True:
                size_line = self.rfile.readline(1024)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                total += size
                if total > MAX_BODY_BYTES:
                    raise HttpError(413, "request body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(1024)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise HttpError(413, "request body too large")
        return self.rfile.read(length) if length else b""

    def _dispatch(self) -> None:
        emu = self.server.emu
        url = urlsplit(self.path)
        path = url.path
        if path.rstrip("/") == SOCKETIO_PATH:
            emu.events.handle(self)
            return
        pty_route = PtyService.WS_PATH.match(path)
        if pty_route is not None and (self.headers.get("Upgrade") or "").lower() == "websocket":
            if emu.latency > 0:
                time.sleep(emu.latency)
            refused = emu.ptys.upgrade(self, pty_route, parse_qs(url.query, keep_blank_values=True))
            emu.record(RequestRecord(self.command, path, url.query, refused.status if refused else 101))
            if refused is not None:
                self.close_connection = True
                self._send(refused)
            return
        try:
            body = self._read_body()
        except (ValueError, HttpError):
            self.close_connection = True
            self._send(Response(400, b'{"message":"malformed body"}'))
            return
        req = Request(self.command, path, parse_qs(url.query, keep_blank_values=True), self.headers, body)
        if emu.latency > 0:
            time.sleep(emu.latency)  # the network between a client and the service, one way
        cut_after = emu.proxy_timeout
        if cut_after is None:
            resp = emu.handle(req)
        else:
            # A load balancer in front of the API ends a request that runs longer than its
            # idle timeout with 504, while the work behind it goes on (the command still runs).
            box: list[Response] = []
            worker = threading.Thread(target=lambda: box.append(emu.handle(req)), daemon=True)
            worker.start()
            worker.join(cut_after)
            if box:
                resp = box[0]
            else:
                emu.record(RequestRecord(self.command, path, url.query, 504))
                emu.cut_requests += 1
                self.close_connection = True
                self._send(Response(504, b"<html><body><h1>504 Gateway Time-out</h1></body></html>", "text/html"))
                return
        emu.record(RequestRecord(self.command, path, url.query, resp.status))
        self._send(resp)

    def _send(self, resp: Response) -> None:
        self.send_response(resp.status)
        if resp.content_type:
            self.send_header("Content-Type", resp.content_type)
        for key, value in resp.headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(resp.body)))
        self._headers_buffer.append(b"\r\n")
        if self.command != "HEAD" and resp.body:
            self._headers_buffer.append(resp.body)
        self.flush_headers()


class DaytonaEmulator:
    """A local stand-in for the Daytona API that the unmodified ``daytona`` SDK talks to.

    Knobs for tests:
        ``fail_next(status, ...)``    the next matching request(s) fail with ``status``
        ``force_state(id, state)``    put a sandbox into a state (``error`` kills its processes)
        ``create_next_in_state(s)``   the next created sandbox lands in state ``s``
        ``transition_delay``          seconds a start/stop/create spends in its transitional state
        ``transition_delays``         per transitional state (``{"archiving": 2.0}``), over ``transition_delay``
        ``minute_s``                  seconds in one of the service's minutes: a started sandbox idle for
                                      ``auto_stop_interval`` minutes stops, a stopped one is archived after
                                      ``auto_archive_interval`` minutes (0: never)
        ``latency``                   seconds added to every request (network and proxy), e.g. 0.02
        ``proxy_timeout``             a request still running after this many seconds gets 504 from the
                                      "load balancer", while its work goes on (None: never)
        ``exit_status_delay``         a session command's exit code shows this long after it ended
        ``output_after_exit``         for this long after the exit code shows, a session command's logs
                                      lack their last ``held_output_bytes`` bytes
        ``max_total_cpu``             quota: creating past it fails with ``quota_status`` (403)
        ``max_exec_seconds``          ceiling on any command (default 600 s)
        ``image_profiles``            image name -> ``ImageProfile`` (its /etc/shells, whether it has bash);
                                      the daemon's shell is picked from it (see ``images.py``)
        ``default_profile``           the profile of a sandbox whose image is not in ``image_profiles``
        ``advertise_toolbox_url``     False: DTOs omit ``toolboxProxyUrl`` (SDK fetches it)
    """

    def __init__(self, *, api_key: str | None = None, root: str | Path | None = None, keep_files: bool = False):
        self.api_key = api_key or f"emu-{secrets.token_hex(16)}"
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="daytona-emu-") if root is None else root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_files = keep_files
        self.lock = threading.RLock()
        self._sandboxes: dict[str, EmulatedSandbox] = {}
        self._failures: list[InjectedFailure] = []
        self._create_states: collections.deque[tuple[str, str | None]] = collections.deque()
        self._timers: set[threading.Timer] = set()
        self._requests: collections.deque[RequestRecord] = collections.deque(maxlen=10_000)
        self.transition_delay = 0.0
        self.transition_delays: dict[str, float] = {}
        self.minute_s = 60.0
        self.latency = 0.0
        self.proxy_timeout: float | None = None
        self.cut_requests = 0
        self.uploaded_paths: list[str] = []  # every path a bulk upload wrote, in order
        self.exit_status_delay = 0.0
        self.output_after_exit = 0.0
        self.held_output_bytes = 256
        self._state_changed = threading.Condition(self.lock)
        self._ticker_stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self.max_total_cpu: int | None = None
        self.quota_status = 403
        self.max_exec_seconds = 600.0
        self.image_profiles: dict[str, ImageProfile] = dict(DEFAULT_PROFILES)
        self.default_profile: ImageProfile = DEBIAN
        self.advertise_toolbox_url = True
        self.events = EventHub(self)
        self._router = Router()
        ControlPlane(self).register(self._router, API_PREFIX)
        toolbox = Toolbox(self)
        toolbox.register(self._router, TOOLBOX_PREFIX)
        self.ptys = PtyService(self)
        self.ptys.register(self._router, TOOLBOX_PREFIX, toolbox.running)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Self:
        if self._server is not None:
            return self
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="daytona-emulator", daemon=True
        )
        self._thread.start()
        self._ticker_stop.clear()
        self._ticker = threading.Thread(target=self._tick, name="daytona-emulator-auto", daemon=True)
        self._ticker.start()
        return self

    def _tick(self) -> None:
        """Auto-stop and auto-archive, as the service applies ``autoStopInterval`` and
        ``autoArchiveInterval`` (minutes; docs: sandbox management, "Auto-stop interval":
        a sandbox idle that long stops, 0 disables it; "Auto-archive interval": a sandbox
        stopped that long is archived). Idle means no request about the sandbox."""
        while not self._ticker_stop.wait(0.02):
            now = time.monotonic()
            for sb in self.all_sandboxes():
                with sb.lock:
                    state, idle = sb.state, now - sb.last_activity
                    stop_after = sb.auto_stop_interval * self.minute_s
                    stopped_for = None if sb.stopped_at is None else now - sb.stopped_at
                    archive_after = sb.auto_archive_interval * self.minute_s
                if state == "started" and sb.auto_stop_interval > 0 and idle >= stop_after:
                    sb.kill_processes()
                    self.transition(sb, via="stopping", final="stopped")
                elif (
                    state == "stopped" and sb.auto_archive_interval > 0
                    and stopped_for is not None and stopped_for >= archive_after
                ):
                    self.transition(sb, via="archiving", final="archived")

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        self._ticker_stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        self.events.close()
        with server.sockets_lock:
            conns = list(server.open_sockets)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self.lock:
            timers = list(self._timers)
            self._timers.clear()
            sandboxes = list(self._sandboxes.values())
        for timer in timers:
            timer.cancel()
        for sb in sandboxes:
            sb.kill_processes()
        if self._own_root and not self.keep_files:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------- URLs
    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("emulator is not running")
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.base_url}{API_PREFIX}"

    @property
    def toolbox_url(self) -> str:
        return f"{self.base_url}{TOOLBOX_PREFIX}"

    @property
    def advertised_toolbox_url(self) -> str:
        """What DTOs carry as ``toolboxProxyUrl``: empty when ``advertise_toolbox_url`` is off,
        which makes the SDK ask ``GET /sandbox/{id}/toolbox-proxy-url`` instead."""
        return self.toolbox_url if self.advertise_toolbox_url else ""

    def sdk_env(self) -> dict[str, str]:
        """Environment variables that point ``Daytona()`` at this emulator."""
        return {"DAYTONA_API_URL": self.api_url, "DAYTONA_API_KEY": self.api_key}

    # ------------------------------------------------------------ test controls
    @property
    def sandboxes(self) -> dict[str, EmulatedSandbox]:
        """A snapshot of the live (not destroyed) sandboxes, by id."""
        with self.lock:
            return dict(self._sandboxes)

    @property
    def requests(self) -> list[RequestRecord]:
        """Requests served so far (socket.io handshakes excluded), oldest first."""
        with self.lock:
            return list(self._requests)

    def fail_next(
        self,
        status: int = 500,
        *,
        method: str | None = None,
        path: str | None = None,
        times: int = 1,
        message: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Fail the next ``times`` requests matching ``method`` and the ``path`` regex (searched)."""
        if status == 429 and headers is None:
            headers = {"Retry-After": "1"}
        failure = InjectedFailure(
            status=status,
            method=method.upper() if method else None,
            path=re.compile(path) if path else None,
            remaining=times,
            message=message or ("Too Many Requests" if status == 429 else f"injected failure ({status})"),
            code=code,
            headers=dict(headers or {}),
        )
        with self.lock:
            self._failures.append(failure)

    def force_state(
        self, sandbox_id_or_name: str, state: str, *, reason: str | None = None, recoverable: bool | None = None
    ) -> None:
        sb = self.sandbox(sandbox_id_or_name)
        self.set_state(sb, state, reason=reason)
        if recoverable is not None:
            with sb.lock:
                sb.recoverable = recoverable

    def wait_state(self, sandbox_id: str, *states: str, timeout: float = 10.0) -> str:
        """Block until the sandbox is in one of ``states`` (woken by each change); the state."""
        sb = self.sandbox(sandbox_id)
        end = time.monotonic() + timeout
        with self._state_changed:
            while sb.state not in states:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"sandbox {sandbox_id} is {sb.state}, not {'/'.join(states)}, after {timeout}s")
                self._state_changed.wait(left)
            return sb.state

    def create_next_in_state(self, state: str, *, reason: str | None = None) -> None:
        if state not in VALID_STATES:
            raise ValueError(f"unknown sandbox state {state!r}")
        with self.lock:
            self._create_states.append((state, reason))

    # --------------------------------------------------------- used by routes
    def record(self, rec: RequestRecord) -> None:
        with self.lock:
            self._requests.append(rec)

    def sandbox(self, id_or_name: str, *, source: str = SOURCE_API) -> EmulatedSandbox:
        sb = self.find(id_or_name)
        if sb is None:
            raise HttpError(404, f"Sandbox with ID or name {id_or_name} not found", source=source)
        return sb

    def find(self, id_or_name: str) -> EmulatedSandbox | None:
        with self.lock:
            sb = self._sandboxes.get(id_or_name)
            if sb is not None:
                return sb
            for candidate in self._sandboxes.values():
                if candidate.name == id_or_name:
                    return candidate
        return None

    def all_sandboxes(self) -> list[EmulatedSandbox]:
        with self.lock:
            return list(self._sandboxes.values())

    def profile_of(self, image: str | None) -> ImageProfile:
        return profile_for(image, self.image_profiles, self.default_profile)

    def add(self, sb: EmulatedSandbox) -> None:
        with self.lock:
            self._sandboxes[sb.id] = sb

    def pop_create_state(self) -> tuple[str, str | None] | None:
        with self.lock:
            return self._create_states.popleft() if self._create_states else None

    def check_quota(self, cpu: int) -> None:
        if self.max_total_cpu is None:
            return
        with self.lock:
            used = sum(s.cpu for s in self._sandboxes.values() if s.state not in ("stopped", "archived", "error"))
        if used + cpu > self.max_total_cpu:
            raise HttpError(self.quota_status, f"Total CPU limit exceeded. Maximum allowed: {self.max_total_cpu}.")

    def set_state(self, sb: EmulatedSandbox, state: str, *, reason: str | None = None) -> None:
        if state not in VALID_STATES:
            raise ValueError(f"unknown sandbox state {state!r}")
        if state in ("error", "build_failed", "stopped", "archived", "destroyed"):
            sb.kill_processes()
        with sb.lock:
            old = sb.set_state(state, reason=reason)
            dto = sb.to_dto(self.toolbox_url) if self._server is not None else None
        if state == "destroyed":
            with self.lock:
                self._sandboxes.pop(sb.id, None)
            if not self.keep_files:
                sb.remove_files()
        with self._state_changed:
            self._state_changed.notify_all()
        if old != state and dto is not None:
            self.events.state_changed(dto, old, state)

    def transition(self, sb: EmulatedSandbox, *, via: str, final: str) -> None:
        """Move to ``final``, spending ``transition_delay`` seconds in ``via`` first."""
        delay = self.transition_delays.get(via, self.transition_delay)
        if delay <= 0:
            self.set_state(sb, final)
            return
        self.set_state(sb, via)

        def settle() -> None:
            with self.lock:
                self._timers.discard(timer)
            with sb.lock:
                still = sb.state == via
            if still:
                self.set_state(sb, final)

        timer = threading.Timer(delay, settle)
        timer.daemon = True
        with self.lock:
            self._timers.add(timer)
        timer.start()

    def destroy(self, sb: EmulatedSandbox) -> None:
        self.set_state(sb, "destroyed")

    # ----------------------------------------------------------------- dispatch
    def take_failure(self, method: str, path: str) -> InjectedFailure | None:
        with self.lock:
            for failure in self._failures:
                if failure.matches(method, path):
                    failure.remaining -= 1
                    if failure.remaining <= 0:
                        self._failures.remove(failure)
                    return failure
        return None

    def authorized(self, req: Request) -> bool:
        return secrets.compare_digest(req.headers.get("Authorization", ""), f"Bearer {self.api_key}")

    def handle(self, req: Request) -> Response:
        try:
            failure = self.take_failure(req.method, req.path)
            if failure is not None:
                raise HttpError(failure.status, failure.message, code=failure.code, headers=failure.headers)
            if not self.authorized(req):
                raise HttpError(401, "Unauthorized", code="UNAUTHORIZED")
            matched = self._router.match(req.method, req.path)
            if matched is None:
                raise HttpError(404, f"Cannot {req.method} {req.path}")
            handler, req.params = matched
            return handler(req)
        except HttpError as err:
            resp = json_response(err.body(req.method, req.path), status=err.status)
            resp.headers.update(err.headers)
            return resp
        except Exception as exc:  # noqa: BLE001 - a bug in the emulator: say so, as a 500
            resp = json_response({"statusCode": 500, "message": f"emulator error: {exc!r}"}, status=500)
            return resp
