"""The ``pods/exec`` websocket, channel protocols ``v4.channel.k8s.io`` and ``v5.channel.k8s.io``.

The wire format, as documented in apimachinery's ``pkg/util/httpstream/wsstream``
(conn.go) and KEP-3396 (kubernetes/enhancements, keps/sig-api-machinery/
3396-websocket-protocol-enhancements), and as the Python client's
``kubernetes/stream/ws_client.py`` reads it:

* every binary message starts with one channel byte: 0 stdin, 1 stdout,
  2 stderr, 3 error (v4+: a JSON ``metav1.Status`` written once when the command
  ends; ``Success``, or ``Failure`` with reason ``NonZeroExitCode`` and the exit
  code in ``details.causes[0].message``), 4 resize (JSON ``{"Width","Height"}``);
* v5 adds channel 255, CLOSE: a message ``[255, N]`` says that the sender will
  write nothing more on channel N; a client closes stdin with ``[255, 0]``;
* the sub-protocol is picked from the client's ``Sec-WebSocket-Protocol`` list;
  servers that do not offer v5 fall back to v4, where stdin cannot be half-closed.

The command runs as a Docker exec in the pod's container; its attach stream
(8-byte frame headers, stream type in byte 0) is split back into channels 1 and 2.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from .store import ApiError, status

if TYPE_CHECKING:
    from .server import KubeEmulator

STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255
V4, V5 = "v4.channel.k8s.io", "v5.channel.k8s.io"


def exit_status(code: int, command: list[str]) -> dict[str, Any]:
    if code == 0:
        return {"metadata": {}, "status": "Success"}
    return {
        "metadata": {}, "status": "Failure",
        "message": f"command terminated with non-zero exit code: error executing command {command}, exit code {code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }


async def handle_exec(emu: KubeEmulator, request: web.Request, namespace: str, name: str) -> web.StreamResponse:
    query = request.query
    command = query.getall("command", [])
    want_stdin = query.get("stdin", "false").lower() in ("true", "1")
    if query.get("tty", "false").lower() in ("true", "1"):
        raise ApiError(status(400, "BadRequest", "tty is not supported by this emulator"))
    if not command:
        raise ApiError(status(400, "BadRequest", "you must specify at least 1 command"))
    emu.authorize(request, "get", "pods/exec", namespace, name)
    emu.authorize(request, "create", "pods/exec", namespace, name)
    pod = emu.get_pod(namespace, name)
    containers = [c["name"] for c in pod["spec"]["containers"]]
    wanted = query.get("container") or (containers[0] if len(containers) == 1 else "")
    if wanted not in containers:
        raise ApiError(status(400, "BadRequest",
                              f"a container name must be specified for pod {name}, choose one of: {containers}"))
    phase = pod["status"].get("phase")
    if phase in ("Succeeded", "Failed"):
        raise ApiError(status(400, "BadRequest",
                              f"cannot exec into a container in a completed pod; current phase is {phase}"))
    cid = emu.kubelet.containers.get(pod["metadata"]["uid"])
    if phase != "Running" or cid is None:
        raise ApiError(status(400, "BadRequest", f'unable to upgrade connection: container not found ("{wanted}")'))
    ws = web.WebSocketResponse(protocols=emu.exec_protocols, max_msg_size=0, autoping=False)
    await ws.prepare(request)
    if ws.ws_protocol not in (V4, V5):
        await ws.close(code=1002, message=b"no supported channel protocol offered")
        return ws
    emu.exec_log.append({"pod": name, "namespace": namespace, "command": command, "protocol": ws.ws_protocol})
    loop = asyncio.get_running_loop()
    api = emu.docker.api
    exec_id = (await loop.run_in_executor(None, lambda: api.exec_create(
        cid, command, stdin=want_stdin, stdout=True, stderr=True, tty=False)))["Id"]
    sock = await loop.run_in_executor(None, lambda: api.exec_start(exec_id, socket=True))
    raw: socket.socket = getattr(sock, "_sock", sock)  # the SDK hands back a SocketIO; the socket is inside
    raw.settimeout(None)
    done = asyncio.Event()

    def pump() -> None:  # docker attach stream -> channels 1 and 2
        buf = b""
        try:
            while True:
                chunk = raw.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 8:
                    size = int.from_bytes(buf[4:8], "big")
                    if len(buf) < 8 + size:
                        break
                    channel, data, buf = buf[0], buf[8:8 + size], buf[8 + size:]
                    if data and channel in (STDOUT, STDERR):
                        if loop.is_closed():
                            return
                        asyncio.run_coroutine_threadsafe(ws.send_bytes(bytes([channel]) + data), loop).result()
        except Exception:  # noqa: BLE001, S110 - the client went away
            pass
        finally:
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:
                pass  # the emulator stopped first

    threading.Thread(target=pump, name="emu-exec-pump", daemon=True).start()

    async def read_client() -> None:  # channel 0 -> the exec's stdin
        async for msg in ws:
            if msg.type == WSMsgType.PING:  # a client's keepalive: answered, and counted for the tests
                emu.pings += 1
                await ws.pong(msg.data)
                continue
            if msg.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                continue
            data = msg.data if isinstance(msg.data, bytes) else msg.data.encode()
            if not data:
                continue
            if data[0] == CLOSE and ws.ws_protocol == V5 and data[1:2] == bytes([STDIN]):
                await loop.run_in_executor(None, _shut_wr, raw)
            elif data[0] == STDIN and want_stdin and len(data) > 1:
                await loop.run_in_executor(None, raw.sendall, data[1:])
        # The client hung up: like the kubelet, leave the process running without its stream.
        done.set()

    reader = asyncio.ensure_future(read_client())
    await done.wait()
    reader.cancel()
    if not ws.closed:
        info = await loop.run_in_executor(None, api.exec_inspect, exec_id)
        for _ in range(1000):  # the engine may report the exit a little after the stream ends
            if not info.get("Running") and info.get("ExitCode") is not None:
                break
            await asyncio.sleep(0.005)
            info = await loop.run_in_executor(None, api.exec_inspect, exec_id)
        code = info.get("ExitCode")
        body = exit_status(int(code), command) if code is not None else {
            "metadata": {}, "status": "Failure", "reason": "InternalError", "message": "exit code not reported"}
        await ws.send_bytes(bytes([ERROR]) + json.dumps(body).encode())
        await ws.close()
    try:
        raw.close()
    except OSError:
        pass
    return ws


def _shut_wr(raw: socket.socket) -> None:
    try:
        raw.shutdown(socket.SHUT_WR)
    except OSError:
        pass
