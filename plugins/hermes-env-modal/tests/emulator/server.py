"""``ModalEmulator``: both gRPC services on 127.0.0.1, in a background thread with its own loop.

- Control plane (``modal.client.ModalClient``): plaintext HTTP/2 at ``server_url``.
- Task command router (``modal.task_command_router.TaskCommandRouter``): TLS with a
  self-signed certificate at ``router_url`` (the client skips verification because its
  server URL is localhost).

The handler tables come from the generated grpclib base classes shipped in ``modal_proto``
(``ModalClientBase``, ``TaskCommandRouterBase``), so every RPC the client can call is routed:
implemented ones to ``api.ControlPlane`` / ``router.CommandRouter``, the rest answer
UNIMPLEMENTED and are listed in ``emu.unimplemented``.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Self

import grpclib.const
import grpclib.server
from grpclib import GRPCError, Status
from modal_proto.api_grpc import ModalClientBase
from modal_proto.task_command_router_grpc import TaskCommandRouterBase

from .api import ControlPlane
from .router import CommandRouter
from .state import Store
from .tls import make_server_context

_CARD = grpclib.const.Cardinality


@dataclass
class _Fault:
    status: Status
    message: str
    remaining: int


def _to_status(value: Any) -> Status:
    if isinstance(value, Status):
        return value
    if isinstance(value, str):
        return Status[value.upper()]
    raw = getattr(
        value, "value", value
    )  # e.g. grpc.StatusCode, whose value is (code, name)
    return Status(raw[0] if isinstance(raw, tuple) else int(raw))


class _Servable:
    def __init__(self, mapping: dict) -> None:
        self._mapping = mapping

    def __mapping__(self) -> dict:
        return self._mapping


#: What the tests call realistic: a 20 ms round trip (a client in the same
#: region), the exit status 100 ms after the exit and output 250 ms after it is
#: written, so output trails the exit status. Modal publishes no such figures;
#: these are chosen to exercise the orderings the SDK's own retry code allows.
REALISTIC = {"rpc_latency": 0.02, "exit_status_delay": 0.1, "output_delay": 0.25}


class ModalEmulator:
    """Local stand-in for the Modal API as used by ``modal.Sandbox``.

    Usage::

        with ModalEmulator() as emu:
            os.environ.update(emu.env)   # before the SDK builds its client
            ...
            emu.fail_next("SandboxCreateV2", Status.PERMISSION_DENIED)
    """

    def __init__(
        self,
        *,
        token_id: str = "ak-emulator",
        token_secret: str = "as-emulator",
        router_jwt_lifetime: float = 3600.0,
        base_dir: str | Path | None = None,
        keep_files: bool = False,
        startup_timeout: float = 15.0,
        shutdown_timeout: float = 15.0,
        rpc_latency: float = 0.0,
        exit_status_delay: float = 0.0,
        output_delay: float = 0.0,
        cut_long_requests_after: float | None = None,
        image_lacks: tuple[str, ...] = (),
    ) -> None:
        self.token_id = token_id
        self.token_secret = token_secret
        self.router_jwt_lifetime = router_jwt_lifetime
        self.keep_files = keep_files
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.base_dir = (
            Path(base_dir)
            if base_dir
            else Path(tempfile.mkdtemp(prefix="modal-emulator-"))
        )
        self.tls_tool: str | None = None
        self.server_port: int | None = None
        self.router_port: int | None = None
        self.calls: list[str] = []  # "Service/Method" in arrival order
        self.unimplemented: set[str] = set()
        self.errors: list[str] = []  # unexpected exceptions inside handlers
        self._counts: Counter[str] = Counter()
        self._faults: dict[str, list[_Fault]] = {}
        self._lock = threading.Lock()
        self._issued_auth_tokens: set[str] = set()
        self._issued_router_tokens: dict[str, str] = {}
        self._store = Store(self.base_dir)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._servers: list[grpclib.server.Server] = []
        # -- knobs for what the real service does (tests may change them at any time) --
        #: a network round trip: every RPC is answered this much later.
        self.rpc_latency: float = rpc_latency
        #: TaskExecWait/TaskExecPoll learn an exec's exit status this long after it exited.
        self.exit_status_delay: float = exit_status_delay
        #: output reaches TaskExecStdioRead readers this long after it was written,
        #: so with a larger value than exit_status_delay it comes after the exit status.
        self.output_delay: float = output_delay
        #: a proxy cuts held requests (TaskExecWait, stdio streams) after this many
        #: seconds with UNAVAILABLE; None: never.
        self.cut_long_requests_after: float | None = cut_long_requests_after
        #: programs missing from sandboxes created from now on (an image without bash).
        self.image_lacks: set[str] = set(image_lacks)

    # -- public surface ------------------------------------------------------------------
    @property
    def server_url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    @property
    def router_url(self) -> str:
        return f"https://127.0.0.1:{self.router_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment that points the SDK at this emulator.

        ``MODAL_CONFIG_PATH`` only matters to a process that imports ``modal`` after it
        is set (e.g. a subprocess): it keeps a developer's ``~/.modal.toml`` out of the way.
        """
        return {
            "MODAL_SERVER_URL": self.server_url,
            "MODAL_TOKEN_ID": self.token_id,
            "MODAL_TOKEN_SECRET": self.token_secret,
            "MODAL_CONFIG_PATH": str(self.base_dir / "no-modal.toml"),
        }

    @property
    def sandboxes(self):
        """Read-only view: sandbox id -> ``state.SandboxState`` (root dir, execs, result...)."""
        return MappingProxyType(self._store.sandboxes)

    @property
    def images(self):
        return MappingProxyType(self._store.images)

    @property
    def apps(self):
        return MappingProxyType(self._store.apps)

    @property
    def unknown_image_ids(self) -> list[str]:
        return list(self._store.unknown_image_ids)

    def call_count(self, method: str) -> int:
        with self._lock:
            return self._counts[method.rsplit("/", 1)[-1]]

    def fail_next(
        self,
        method: str,
        grpc_status: Any,
        *,
        count: int = 1,
        message: str | None = None,
    ) -> None:
        """Make the next ``count`` calls of ``method`` (e.g. ``"SandboxCreateV2"``) fail.

        Note the client retries some statuses by itself (UNAVAILABLE, INTERNAL, UNKNOWN,
        CANCELLED, DEADLINE_EXCEEDED: 3 retries on the control plane, 10 on the router), so
        a single injected retryable error is normally invisible to the caller.
        """
        name = method.rsplit("/", 1)[-1]
        status = _to_status(grpc_status)
        with self._lock:
            self._faults.setdefault(name, []).append(
                _Fault(
                    status,
                    message or f"emulator: injected {status.name} for {name}",
                    count,
                )
            )

    def run(self, coro, timeout: float = 30.0):
        """Run a coroutine on the emulator's loop and return its result (bounded)."""
        if self._loop is None:
            raise RuntimeError("emulator is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def assert_alive(self, timeout: float = 2.0) -> None:
        """Raise at once (instead of letting the SDK retry for ~60 s) if a port is not accepting."""
        for port in (self.server_port, self.router_port):
            if port is None:
                raise RuntimeError("emulator was never started")
            with socket.create_connection(("127.0.0.1", port), timeout=timeout):
                pass

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError("emulator already started")
        self._thread = threading.Thread(
            target=self._thread_main, name="modal-emulator", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(self.startup_timeout):
            raise TimeoutError(
                f"modal emulator did not start within {self.startup_timeout}s"
            )
        if self._startup_error is not None:
            self._thread.join(self.shutdown_timeout)
            raise RuntimeError(
                "modal emulator failed to start"
            ) from self._startup_error
        self.assert_alive()
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if (
            loop is not None
            and thread is not None
            and thread.is_alive()
            and self._stop is not None
        ):
            loop.call_soon_threadsafe(self._stop.set)
            thread.join(self.shutdown_timeout)
            if thread.is_alive():
                raise RuntimeError(
                    f"modal emulator did not stop within {self.shutdown_timeout}s"
                )
        if not self.keep_files:
            self._store.remove_files()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------------------
    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._amain())
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _amain(self) -> None:
        self._stop = asyncio.Event()
        try:
            await self._start_servers()
        except BaseException as exc:  # noqa: BLE001 - re-raised by start()
            self._startup_error = exc
            self._ready.set()
            await self._close_servers()
            return
        self._ready.set()
        await self._stop.wait()
        try:
            await asyncio.wait_for(self._store.shutdown(), self.shutdown_timeout / 2)
        finally:
            await self._close_servers()

    @staticmethod
    def _listen() -> socket.socket:
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto says TCP, and without it every RPC stalls ~40 ms on Nagle + delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        return sock

    async def _start_servers(self) -> None:
        ssl_ctx, self.tls_tool = await asyncio.to_thread(
            make_server_context, self.base_dir
        )
        control = grpclib.server.Server(
            [_Servable(self._mapping(ModalClientBase, ControlPlane(self)))]
        )
        router = grpclib.server.Server(
            [_Servable(self._mapping(TaskCommandRouterBase, CommandRouter(self)))]
        )
        self._servers = [control, router]
        main_sock, router_sock = self._listen(), self._listen()
        self.server_port = main_sock.getsockname()[1]
        self.router_port = router_sock.getsockname()[1]
        await control.start(sock=main_sock)
        await router.start(sock=router_sock, ssl=ssl_ctx)

    async def _close_servers(self) -> None:
        for server in self._servers:
            try:
                server.close()
            except RuntimeError:  # never started
                continue
        for server in self._servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 5.0)
            except (TimeoutError, RuntimeError):
                pass

    def _take_fault(self, name: str) -> _Fault | None:
        with self._lock:
            self._counts[name] += 1
            queue = self._faults.get(name)
            if not queue:
                return None
            fault = queue[0]
            fault.remaining -= 1
            if fault.remaining <= 0:
                queue.pop(0)
            return fault

    def _mapping(self, base_cls: type, impl: Any) -> dict:
        """Route every RPC declared by the generated base class through ``_dispatch``."""
        emu = self

        class _Collector:
            def __getattr__(self, name: str):
                return (
                    name  # the placeholder 'func' the template gets: the method's name
                )

        template: dict = base_cls.__mapping__(_Collector())
        mapping = {}
        for path, h in template.items():
            service, method = path.strip("/").split("/")
            mapping[path] = grpclib.const.Handler(
                emu._make_handler(
                    impl, service.rsplit(".", 1)[-1], method, h.cardinality
                ),
                h.cardinality,
                h.request_type,
                h.reply_type,
            )
        return mapping

    def _make_handler(self, impl: Any, service: str, method: str, cardinality):
        fn = getattr(impl, method, None)

        async def handler(stream: grpclib.server.Stream) -> None:
            with self._lock:
                self.calls.append(f"{service}/{method}")
            fault = self._take_fault(method)
            if fault is not None:
                raise GRPCError(fault.status, fault.message)
            if fn is None:
                self.unimplemented.add(f"{service}/{method}")
                raise GRPCError(
                    Status.UNIMPLEMENTED,
                    f"emulator: {service}/{method} is not implemented",
                )
            impl.check_auth(stream)
            if self.rpc_latency > 0:
                await asyncio.sleep(self.rpc_latency)
            try:
                if cardinality is _CARD.UNARY_UNARY:
                    req = await stream.recv_message()
                    await stream.send_message(await fn(req, stream))
                elif cardinality is _CARD.UNARY_STREAM:
                    req = await stream.recv_message()
                    agen = fn(req, stream)
                    try:
                        async for resp in agen:
                            await stream.send_message(resp)
                    finally:
                        await agen.aclose()
                else:
                    await fn(stream)
            except (GRPCError, asyncio.CancelledError):
                raise
            except Exception as exc:  # a bug in the emulator: make it visible to tests
                self.errors.append(f"{service}/{method}: {exc!r}")
                raise GRPCError(
                    Status.INTERNAL, f"emulator error in {method}: {exc!r}"
                ) from exc

        return handler
