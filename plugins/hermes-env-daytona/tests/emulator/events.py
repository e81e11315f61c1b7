"""The SDK's real-time event gateway: just enough Socket.IO to push state changes.

``Daytona()`` opens a Socket.IO connection to ``{origin}{api path}/socket.io/``
(websocket transport only, token in the CONNECT auth payload) and waits for
``sandbox.state.updated`` / ``sandbox.created`` events; polling every second is
only its safety net.  Serving the events lets state waits finish when the state
changes rather than on the next poll.

Spoken here: RFC 6455 framing (text, ping/pong, close), Engine.IO v4 (OPEN,
PING/PONG, MESSAGE, CLOSE) and Socket.IO v5 on the default namespace (CONNECT,
CONNECT_ERROR, EVENT).  Set ``emu.events.enabled = False`` before the client is
created to answer 404 instead, which forces the SDK onto its polling path.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from .wire import _json_default

if TYPE_CHECKING:
    from daytona_api_client import Sandbox

    from .emulator import DaytonaEmulator, _Handler

_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PING_INTERVAL_MS = 25_000
PING_TIMEOUT_MS = 20_000
_MAX_FRAME = 1 << 20


class _Closed(Exception):
    pass


class _Connection:
    def __init__(self, handler: _Handler) -> None:
        self.handler = handler
        self.sock: socket.socket = handler.connection
        self.rfile = handler.rfile
        self.send_lock = threading.Lock()
        self.joined = False  # completed the Socket.IO CONNECT
        self.closed = threading.Event()

    # ------------------------------------------------------------- websocket
    def _read_exact(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if data is None or len(data) < n:
            raise _Closed()
        return data

    def read_message(self) -> str | None:
        """The next text message, answering control frames; None on close."""
        parts: list[bytes] = []
        while True:
            b1, b2 = self._read_exact(2)
            opcode, fin = b1 & 0x0F, bool(b1 & 0x80)
            length = b2 & 0x7F
            if length == 126:
                (length,) = struct.unpack(">H", self._read_exact(2))
            elif length == 127:
                (length,) = struct.unpack(">Q", self._read_exact(8))
            if length > _MAX_FRAME:
                raise _Closed()
            mask = self._read_exact(4) if b2 & 0x80 else b"\x00\x00\x00\x00"
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(self._read_exact(length)))
            if opcode == 0x8:
                self._send_frame(0x8, payload[:2])
                return None
            if opcode == 0x9:
                self._send_frame(0xA, payload)
                continue
            if opcode == 0xA:
                continue
            parts.append(payload)
            if fin:
                return b"".join(parts).decode("utf-8", errors="replace")

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        header = bytearray([0x80 | opcode])
        if len(payload) < 126:
            header.append(len(payload))
        elif len(payload) < 1 << 16:
            header.append(126)
            header += struct.pack(">H", len(payload))
        else:
            header.append(127)
            header += struct.pack(">Q", len(payload))
        with self.send_lock:
            self.sock.sendall(bytes(header) + payload)

    def send_text(self, text: str) -> None:
        try:
            self._send_frame(0x1, text.encode("utf-8"))
        except OSError:
            self.closed.set()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            self.send_text("1")  # Engine.IO CLOSE
            self._send_frame(0x8, struct.pack(">H", 1001))
        except OSError:
            pass


class EventHub:
    def __init__(self, emu: DaytonaEmulator) -> None:
        self.emu = emu
        self.enabled = True
        self._lock = threading.Lock()
        self._joined = threading.Condition(self._lock)
        self._conns: set[_Connection] = set()
        self._closing = False

    @property
    def connected(self) -> int:
        """How many SDK clients have joined (completed the Socket.IO CONNECT)."""
        with self._lock:
            return sum(1 for c in self._conns if c.joined)

    def wait_connected(self, count: int = 1, timeout: float = 10.0) -> bool:
        """Block until ``count`` SDK clients have joined (woken by each join), or ``timeout``."""
        with self._joined:
            return self._joined.wait_for(lambda: sum(1 for c in self._conns if c.joined) >= count, timeout)

    # -------------------------------------------------------------- upgrade
    def handle(self, handler: _Handler) -> None:
        handler.close_connection = True
        key = handler.headers.get("Sec-WebSocket-Key")
        upgrade = (handler.headers.get("Upgrade") or "").lower()
        if not self.enabled or self._closing or upgrade != "websocket" or not key:
            body = b'{"message":"socket.io is not served"}'
            handler.send_response(404)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return
        accept = base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()
        handler.send_response(101, "Switching Protocols")
        handler.send_header("Upgrade", "websocket")
        handler.send_header("Connection", "Upgrade")
        handler.send_header("Sec-WebSocket-Accept", accept)
        handler.end_headers()
        handler.wfile.flush()

        conn = _Connection(handler)
        with self._lock:
            self._conns.add(conn)
        pinger = threading.Thread(target=self._ping_loop, args=(conn,), name="emu-sio-ping", daemon=True)
        try:
            open_payload = {
                "sid": secrets.token_hex(10),
                "upgrades": [],
                "pingInterval": PING_INTERVAL_MS,
                "pingTimeout": PING_TIMEOUT_MS,
                "maxPayload": _MAX_FRAME,
            }
            conn.send_text("0" + json.dumps(open_payload))
            pinger.start()
            self._read_loop(conn)
        except (_Closed, OSError):
            pass
        finally:
            conn.closed.set()
            with self._lock:
                self._conns.discard(conn)

    def _ping_loop(self, conn: _Connection) -> None:
        while not conn.closed.wait(PING_INTERVAL_MS / 1000):
            conn.send_text("2")

    def _read_loop(self, conn: _Connection) -> None:
        while not conn.closed.is_set():
            message = conn.read_message()
            if message is None:
                return
            if message.startswith("1"):  # Engine.IO CLOSE
                return
            if message.startswith("40"):  # Socket.IO CONNECT on "/"
                self._on_connect(conn, message[2:])
            elif message.startswith("41"):  # Socket.IO DISCONNECT
                conn.joined = False
            # "3" (PONG) and anything else need no answer.

    def _on_connect(self, conn: _Connection, payload: str) -> None:
        try:
            auth = json.loads(payload) if payload else {}
        except ValueError:
            auth = {}
        token = auth.get("token") if isinstance(auth, dict) else None
        if not isinstance(token, str) or not secrets.compare_digest(token, self.emu.api_key):
            conn.send_text("44" + json.dumps({"message": "Unauthorized"}))
            return
        conn.send_text("40" + json.dumps({"sid": secrets.token_hex(10)}))
        with self._joined:
            conn.joined = True
            self._joined.notify_all()

    # --------------------------------------------------------------- events
    def emit(self, event: str, data: Any) -> None:
        text = "42" + json.dumps([event, data], default=_json_default)
        with self._lock:
            conns = [c for c in self._conns if c.joined and not c.closed.is_set()]
        for conn in conns:
            conn.send_text(text)

    def state_changed(self, dto: Sandbox, old: str, new: str) -> None:
        self.emit("sandbox.state.updated", {"sandbox": dto.to_dict(), "oldState": old, "newState": new})

    def close(self, grace: float = 2.0) -> None:
        """Say goodbye so clients do not reconnect, then drop whoever is left.

        A Socket.IO DISCONNECT ("41") makes python-socketio disconnect on purpose
        (no reconnect loop against a port that is about to close); a bare transport
        close would count as a dropped connection and start its retry loop.
        """
        self._closing = True
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            if conn.joined:
                conn.send_text("41")
        deadline = time.monotonic() + grace
        for conn in conns:
            conn.closed.wait(max(0.0, deadline - time.monotonic()))
        for conn in conns:
            conn.close()
