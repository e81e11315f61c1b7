"""The daemon's PTY sessions: a real pseudo-terminal per session, reached over a WebSocket.

As the daemon does (apps/daemon/pkg/toolbox/process/pty: ``session.go``,
``websocket.go``, ``controller.go``): a session is ``GetShell()``'s shell
started ``-i -l`` on a new pseudo-terminal (its own session, the terminal its
controlling one, ``TERM=xterm-256color`` unless the client's envs say
otherwise), in the work directory, with the sandbox's environment plus the
envs the client sent (as the ``X-Daytona-Pty-Envs~<base64url JSON>``
WebSocket subprotocol on create-connect). What the terminal prints goes to
every attached client as binary messages; every message a client sends
(text or binary, at most 64 KiB, else the connection is dropped) is written
to the terminal in order. A client that falls 256 messages behind is
dropped ("slow consumer"). On attach the client gets the text message
``{"type":"control","status":"connected"}``; when the shell ends, clients
that offered ``X-Daytona-Pty-Exit-Control`` get ``{"type":"control",
"status":"exited","exitCode":N}``, then every client a close frame (1000
for exit 0, else 1011) whose reason is ``{"exitCode":N,"exitReason":...}``.
``DELETE`` kills the shell's descendants, deepest first, then the shell
(exit 137). A sandbox that stops takes its terminals and connections with it
(the connections are cut, as when the daemon goes away).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import pty
import queue
import re
import shlex
import signal
import socket
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .errors import SOURCE_DAEMON, HttpError
from .wire import Request, Response, Router, json_response

if TYPE_CHECKING:
    from .emulator import DaytonaEmulator
    from .sandboxes import EmulatedSandbox

__all__ = ["EXIT_CONTROL", "PtyService", "PtySession", "WsConnection", "accept_key", "kill_tree"]

EXIT_CONTROL = "X-Daytona-Pty-Exit-Control"
ENVS_PREFIX = "X-Daytona-Pty-Envs~"
READ_LIMIT = 64 * 1024  # types.go readLimit: a bigger message ends the connection
SEND_QUEUE = 256  # websocket.go: a client this far behind is dropped
_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def accept_key(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()


def envs_from_subprotocols(header: str | None) -> dict[str, str]:
    """subprotocol.go: the envs token, base64url (no padding) of a JSON object; ValueError when malformed."""
    for token in (header or "").split(","):
        token = token.strip()
        if token.startswith(ENVS_PREFIX):
            raw = token[len(ENVS_PREFIX) :]
            data = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
            if not isinstance(data, dict):
                raise ValueError("envs must be a JSON object")
            return {str(k): str(v) for k, v in data.items()}
    return {}


class WsConnection:
    """The server side of one RFC 6455 connection (frames from the client are masked)."""

    def __init__(self, sock: socket.socket, rfile: Any, *, exit_control: bool, latency: float = 0.0) -> None:
        self.sock = sock
        #: added to each message from the client, as ``emu.latency`` is to each request (one way per round trip)
        self.latency = latency
        self.rfile = rfile
        self.exit_control = exit_control
        self._send_lock = threading.Lock()
        self.closed = threading.Event()
        self.outbox: queue.Queue[tuple[float, bytes | None]] = queue.Queue(SEND_QUEUE)

    def _read_exact(self, n: int) -> bytes:
        data = self.rfile.read(n) if n else b""
        if data is None or len(data) < n:
            raise EOFError
        return data

    def read_message(self) -> bytes | None:
        """The next data message (text or binary), answering pings; None on close or a broken rule."""
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                b1, b2 = self._read_exact(2)
                opcode, fin, length = b1 & 0x0F, bool(b1 & 0x80), b2 & 0x7F
                if length == 126:
                    (length,) = struct.unpack(">H", self._read_exact(2))
                elif length == 127:
                    (length,) = struct.unpack(">Q", self._read_exact(8))
                mask = self._read_exact(4) if b2 & 0x80 else b"\0\0\0\0"
                if opcode < 0x8 and size + length > READ_LIMIT:
                    self.send_close(1009, "message too big")
                    return None
                raw = self._read_exact(length)
                reps = mask * (length // 4 + 1)
                payload = (int.from_bytes(raw, "big") ^ int.from_bytes(reps[:length], "big")).to_bytes(length, "big")
                if opcode == 0x8:
                    self.send_frame(0x8, payload[:2])
                    return None
                if opcode == 0x9:
                    self.send_frame(0xA, payload)
                    continue
                if opcode == 0xA:
                    continue
                parts.append(payload)
                size += length
                if fin:
                    return b"".join(parts)
        except (EOFError, OSError, ValueError):
            return None

    def send_frame(self, opcode: int, payload: bytes) -> None:
        header = bytearray([0x80 | opcode])
        n = len(payload)
        if n < 126:
            header.append(n)
        elif n < 1 << 16:
            header.append(126)
            header += struct.pack(">H", n)
        else:
            header.append(127)
            header += struct.pack(">Q", n)
        with self._send_lock:
            self.sock.sendall(bytes(header) + payload)

    def send_text(self, text: str) -> None:
        self.send_frame(0x1, text.encode())

    def send_close(self, code: int, reason: str) -> None:
        try:
            self.send_frame(0x8, struct.pack(">H", code) + reason.encode()[:120])
        except OSError:
            pass
        self.closed.set()

    def cut(self) -> None:
        """Drop the connection with no close frame (the daemon went away)."""
        self.closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def kill_tree(pid: int) -> None:
    """session.go killProcessTree: SIGKILL every descendant of ``pid``, deepest first."""
    kids = _children()

    def walk(p: int) -> None:
        for child in kids.get(p, []):
            walk(child)
        for child in kids.get(p, []):
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass

    walk(pid)


def _ctty() -> None:  # runs in the child, after setsid: the terminal becomes its controlling one
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class PtySession:
    """One PTY session of one sandbox."""

    def __init__(
        self, sb: EmulatedSandbox, session_id: str, *, cwd: str, envs: dict[str, str], cols: int, rows: int
    ) -> None:
        self.sb = sb
        self.id = session_id
        self.cwd, self.cols, self.rows = cwd, cols, rows
        self.envs = {"TERM": "xterm-256color", **envs} if not envs.get("TERM") else dict(envs)
        self.created_at = datetime.now(UTC)
        self.active = True
        self.exit_code: int | None = None
        self.exit_reason: str | None = None
        self._lock = threading.Lock()
        self._clients: set[WsConnection] = set()
        env = sb.process_env(self.envs)
        if not sb.profile.has_bash:
            # A login shell's /etc/profile (this machine's) would put bash back on the PATH:
            # the interactive shell's $ENV file, read last, takes it away again.
            rc = sb.state_dir / "pty-no-bash.sh"
            rc.write_text(f"PATH={shlex.quote(env['PATH'])}; export PATH\n")
            env["ENV"] = str(rc)
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        try:
            self.proc = subprocess.Popen(
                [sb.daemon_shell(), "-i", "-l"],
                stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                start_new_session=True, preexec_fn=_ctty,  # noqa: PLW1509 - setsid, then the terminal
            )
        finally:
            os.close(slave)
        self.master = master
        self._write_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, name=f"emu-pty-{session_id}", daemon=True)
        self._reader.start()
        threading.Thread(target=self._reap, name=f"emu-pty-reap-{session_id}", daemon=True).start()

    # ------------------------------------------------------------- terminal
    def _read_loop(self) -> None:
        try:
            self._pump()
        finally:
            with self._write_lock:  # the descriptor is this thread's: closed once nothing reads it
                os.close(self.master)
                self.master = -1

    def _pump(self) -> None:
        while True:
            try:
                data = os.read(self.master, 32 * 1024)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                clients = list(self._clients)
            for cl in clients:
                try:
                    cl.outbox.put_nowait((time.monotonic(), data))
                except queue.Full:
                    self._detach(cl)
                    threading.Thread(target=cl.send_close, args=(1008, "slow consumer"), daemon=True).start()

    def _reap(self) -> None:
        code = self.proc.wait()
        code = code if code >= 0 else 128 - code
        self._reader.join(0.2)  # what it printed last, unless a descendant still holds the terminal
        self._end(code)

    def _end(self, code: int, *, cut: bool = False) -> None:
        reason = {0: None, 130: "Ctrl+C", 137: "SIGKILL", 143: "SIGTERM"}.get(
            code, f"signal {code - 128}" if code > 128 else "non-zero exit"
        )
        with self._lock:
            if not self.active:
                return
            self.active = False
            self.exit_code, self.exit_reason = code, reason
            clients, self._clients = list(self._clients), set()
        with self.sb.lock:
            if self.sb.ptys.get(self.id) is self:
                del self.sb.ptys[self.id]
        for cl in clients:
            if cut:
                cl.cut()
                continue
            cl.outbox.put((time.monotonic(), None))  # after what is queued

    def write(self, data: bytes) -> bool:
        view = memoryview(data)
        with self._write_lock:
            while view and self.master >= 0 and self.active:
                try:
                    view = view[os.write(self.master, view) :]
                except OSError:
                    return False
        return not view

    def kill(self, *, cut: bool = False) -> None:
        """DeletePTYSession (or the sandbox stopping, ``cut``): the tree, then the shell."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            try:
                self.proc.kill()
            except OSError:
                pass
        self._end(137 if self.exit_code is None else self.exit_code, cut=cut)

    def resize(self, cols: int, rows: int) -> None:
        self.cols, self.rows = cols, rows
        with self._write_lock:
            if self.master < 0:
                raise OSError("the terminal is closed")
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id, "cwd": self.cwd, "envs": dict(self.envs), "cols": self.cols, "rows": self.rows,
            "createdAt": self.created_at.isoformat().replace("+00:00", "Z"), "active": self.active, "lazyStart": False,
        }

    # ------------------------------------------------------------- clients
    def _detach(self, cl: WsConnection) -> None:
        with self._lock:
            self._clients.discard(cl)

    def attach(self, cl: WsConnection) -> None:
        """websocket.go attachWebSocket: register, say connected, then copy the client's messages in."""
        with self._lock:
            if not self.active:
                cl.send_text(json.dumps({"type": "control", "status": "error", "error": "PTY session is not active"}))
                return
            self._clients.add(cl)
        writer = threading.Thread(target=self._client_writer, args=(cl,), name=f"emu-pty-out-{self.id}", daemon=True)
        writer.start()
        cl.send_text(json.dumps({"type": "control", "status": "connected"}))
        inbox: queue.Queue[tuple[float, bytes | None]] = queue.Queue(SEND_QUEUE)

        def to_terminal() -> None:  # a delay line: each message reaches the terminal ``latency`` after it came
            while True:
                came, data = inbox.get()
                if data is None:
                    return
                if (due := came + cl.latency - time.monotonic()) > 0:
                    time.sleep(due)
                if not self.write(data):
                    cl.closed.set()
                    return

        feeder = threading.Thread(target=to_terminal, name=f"emu-pty-in-{self.id}", daemon=True)
        feeder.start()
        while not cl.closed.is_set():
            data = cl.read_message()
            if data is None:
                break
            inbox.put((time.monotonic(), data))
        inbox.put((0.0, None))
        self._detach(cl)
        cl.closed.set()
        writer.join(5)

    def _client_writer(self, cl: WsConnection) -> None:
        while True:
            try:
                queued, item = cl.outbox.get(timeout=0.1)
            except queue.Empty:
                if cl.closed.is_set():
                    return
                continue
            try:
                if item is None:
                    code = self.exit_code if self.exit_code is not None else 0
                    reason = self.exit_reason
                    if cl.exit_control:
                        msg = {"type": "control", "status": "exited", "exitCode": code}
                        if reason:
                            msg["exitReason"] = reason
                        cl.send_text(json.dumps(msg))
                    body = {"exitCode": code, **({"exitReason": reason} if reason else {})}
                    cl.send_close(1000 if code == 0 else 1011, json.dumps(body))
                    cl.cut()
                    return
                cl.send_frame(0x2, item)
            except OSError:
                cl.closed.set()
                return



class PtyService:
    """The PTY routes of one emulator: REST on the router, the two WebSocket routes by ``upgrade``."""

    #: /toolbox/{sandbox}/process/pty/create-connect and /toolbox/{sandbox}/process/pty/{session}/connect
    WS_PATH = re.compile(r"^/toolbox/(?P<sid>[^/]+)/process/pty/(?:(?P<create>create-connect)|(?P<session>[^/]+)/connect)/?$")

    def __init__(self, emu: DaytonaEmulator) -> None:
        self.emu = emu

    def register(self, router: Router, prefix: str, running: Callable[[Request], EmulatedSandbox]) -> None:
        self._running = running
        p = f"{prefix}/{{sid}}/process/pty"
        router.add("POST", p, self.create)
        router.add("GET", p, self.list)
        router.add("GET", f"{p}/{{session}}", self.get)
        router.add("DELETE", f"{p}/{{session}}", self.delete)
        router.add("POST", f"{p}/{{session}}/resize", self.resize)

    # ----------------------------------------------------------------- REST
    def _start(self, sb: EmulatedSandbox, sid: str, cwd: str | None, envs: dict[str, str], cols: int, rows: int) -> PtySession:
        if not sid:
            raise HttpError(400, "session ID is required", source=SOURCE_DAEMON)
        if cols > 1000 or rows > 1000:
            raise HttpError(400, "invalid value for cols - must be less than 1000", source=SOURCE_DAEMON)
        with sb.lock:
            if sid in sb.ptys:
                raise HttpError(409, f"PTY session with ID '{sid}' already exists", source=SOURCE_DAEMON)
            where = str(sb.resolve(cwd, default=sb.work_dir))
            session = PtySession(sb, sid, cwd=where, envs=envs, cols=cols, rows=rows)
            sb.ptys[sid] = session
        return session

    def _session(self, req: Request) -> PtySession:
        sb = self._running(req)
        with sb.lock:
            session = sb.ptys.get(req.params["session"])
        if session is None:
            raise HttpError(404, "PTY session not found", source=SOURCE_DAEMON)
        return session

    def create(self, req: Request) -> Response:
        body = req.json()
        sb = self._running(req)
        self._start(
            sb, str(body.get("id") or ""), body.get("cwd"), dict(body.get("envs") or {}),
            int(body.get("cols") or 80), int(body.get("rows") or 24),
        )
        return json_response({"sessionId": body["id"]}, status=201)

    def list(self, req: Request) -> Response:
        sb = self._running(req)
        with sb.lock:
            sessions = list(sb.ptys.values())
        return json_response({"sessions": [s.info() for s in sessions]})

    def get(self, req: Request) -> Response:
        return json_response(self._session(req).info())

    def delete(self, req: Request) -> Response:
        self._session(req).kill()
        return json_response({"message": "PTY session deleted"})

    def resize(self, req: Request) -> Response:
        body = req.json()
        cols, rows = int(body.get("cols") or 0), int(body.get("rows") or 0)
        if not (1 <= cols <= 1000 and 1 <= rows <= 1000):
            raise HttpError(400, "cols and rows must be between 1 and 1000", source=SOURCE_DAEMON)
        session = self._session(req)
        try:
            session.resize(cols, rows)
        except OSError as exc:
            raise HttpError(410, f"cannot resize inactive PTY session: {exc}", source=SOURCE_DAEMON) from exc
        return json_response(session.info())

    # ------------------------------------------------------------- WebSocket
    def upgrade(self, handler: Any, match: re.Match[str], query: dict[str, list[str]]) -> Response | None:
        """Serve a WebSocket route; a Response when the request is refused before the upgrade."""
        emu = self.emu
        arg = lambda name: (query.get(name) or [None])[-1]  # noqa: E731
        req = Request("GET", match.group(0), query, handler.headers, b"", {"sid": match["sid"]})
        try:
            if not handler.headers.get("Sec-WebSocket-Key"):
                raise HttpError(400, "not a websocket request")
            failure = emu.take_failure("GET", req.path)
            if failure is not None:
                raise HttpError(failure.status, failure.message, code=failure.code, headers=failure.headers)
            if not emu.authorized(req):
                raise HttpError(401, "Unauthorized", code="UNAUTHORIZED")
            sb = self._running(req)
            offered = handler.headers.get("Sec-WebSocket-Protocol")
            session: PtySession | None = None
            if match["create"]:
                try:
                    envs = envs_from_subprotocols(offered)
                    cols, rows = int(arg("cols") or 80), int(arg("rows") or 24)
                except ValueError as exc:
                    raise HttpError(400, f"invalid request: {exc}", source=SOURCE_DAEMON) from exc
                session = self._start(sb, arg("id") or "", arg("cwd"), envs, cols, rows)
            else:
                with sb.lock:
                    session = sb.ptys.get(match["session"])
        except HttpError as err:
            resp = json_response(err.body("GET", req.path), status=err.status)
            resp.headers.update(err.headers)
            return resp
        tokens = [t.strip() for t in (offered or "").split(",")]
        handler.close_connection = True
        handler.send_response(101, "Switching Protocols")
        handler.send_header("Upgrade", "websocket")
        handler.send_header("Connection", "Upgrade")
        handler.send_header("Sec-WebSocket-Accept", accept_key(handler.headers["Sec-WebSocket-Key"]))
        if EXIT_CONTROL in tokens:
            handler.send_header("Sec-WebSocket-Protocol", EXIT_CONTROL)
        handler.end_headers()
        handler.wfile.flush()
        conn = WsConnection(handler.connection, handler.rfile, exit_control=EXIT_CONTROL in tokens, latency=emu.latency)
        if session is None:
            # controller.go: upgraded first, then told why, then closed.
            error = f"Failed to connect to PTY session: PTY session {match['session']} not found"
            conn.send_text(json.dumps({"type": "control", "status": "error", "error": error}))
            conn.send_close(1000, "")
            return None
        session.attach(conn)
        return None
