"""``KubeEmulator``: a local Kubernetes API server that the official Python client talks to unchanged.

It serves, on 127.0.0.1 over HTTPS (a throwaway CA) or HTTP, with bearer-token auth:

* ``/version``; namespaces (list/get/create/delete); pods (create/get/list/delete,
  in a namespace and across all), with label and field selectors; events;
* ``pods/{name}/exec`` over websocket (``execws.py``);
* the agent-sandbox CRDs (``sandboxes.py``): ``agents.x-k8s.io`` Sandbox,
  ``extensions.agents.x-k8s.io`` SandboxTemplate, SandboxWarmPool, SandboxClaim.

Knobs for tests: ``deny(verb, resource)`` (RBAC: 403 with the apiserver's
message), ``exec_protocols`` (offer v5+v4 or v4 only), ``node_labels`` /
``node_taints`` / ``node_cpu`` (scheduling), ``start_delay``; an image the
local Docker engine lacks fails to pull. URL layout and verbs follow the API
reference (kubernetes.io/docs/reference/kubernetes-api/) and RBAC's verb mapping
(kubernetes.io/docs/reference/access-authn-authz/authorization/#determine-the-request-verb).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import secrets
import ssl
import tempfile
import threading
from typing import Any

from aiohttp import web

from . import execws
from .kubelet import Kubelet
from .sandboxes import CRDS, SandboxController
from .store import ApiError, Obj, Store, invalid, not_found, now, status

USER = "system:serviceaccount:default:hermes-test"


class KubeEmulator:
    def __init__(self, docker_client: Any, *, tls: bool = True) -> None:
        self.id = secrets.token_hex(4)
        self.docker = docker_client
        self.token = secrets.token_urlsafe(24)
        self.tls = tls
        self.store = Store()
        self.kubelet = Kubelet(self)
        self.sandboxes = SandboxController(self)
        self.denied: set[tuple[str, str]] = set()
        self.exec_protocols: tuple[str, ...] = (execws.V5, execws.V4)
        self.node_name = "emu-node-1"
        self.node_labels = {"kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64"}
        self.node_taints: list[dict[str, str]] = []
        self.node_cpu = 64.0
        self.runtime_classes = {"gvisor", "kata"}
        self.pids_limit = 512
        self.start_delay = 0.0
        self.exec_log: list[dict[str, Any]] = []
        self.pings = 0
        self.requests: list[tuple[str, str]] = []
        for ns in ("default", "kube-system"):
            self.store.create("namespaces", "", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns},
                                                 "status": {"phase": "Active"}})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="kube-emu-")
        self.port = 0
        self.ca_file = ""

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> KubeEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> None:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
            loop.close()

        self._thread = threading.Thread(target=run, name="kube-emulator", daemon=True)
        self._thread.start()
        if not ready.wait(30) or errors:
            raise RuntimeError(f"kube emulator did not start: {errors}")

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        # The apiserver takes request lines up to 1 MiB (Go's http.DefaultMaxHeaderBytes): exec URLs carry argv.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     max_line_size=1 << 20, max_field_size=1 << 16)
        await self._runner.setup()
        ctx = self._ssl_context() if self.tls else None
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _ssl_context(self) -> ssl.SSLContext:
        """A throwaway CA and a server certificate for 127.0.0.1, written for the kubeconfig."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-emulator")])
        start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256())
        )
        self.ca_file = os.path.join(self._tmp.name, "ca.crt")
        key_file = os.path.join(self._tmp.name, "server.key")
        with open(self.ca_file, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(key_file, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.ca_file, key_file)
        return ctx

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self.kubelet.shutdown()
        self._tmp.cleanup()

    def write_kubeconfig(self, path: str, *, context: str = "emulator", namespace: str = "default",
                         token: str | None = None) -> str:
        """A kubeconfig (YAML is a superset of JSON) pointing at this emulator."""
        cluster: Obj = {"server": self.url}
        if self.tls:
            cluster["certificate-authority"] = self.ca_file
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": context,
            "clusters": [{"name": "emu", "cluster": cluster}],
            "users": [{"name": "hermes-test", "user": {"token": token or self.token}}],
            "contexts": [{"name": context, "context": {"cluster": "emu", "user": "hermes-test", "namespace": namespace}}],
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        return path

    # -- test knobs -----------------------------------------------------------------------
    def deny(self, verb: str, resource: str) -> None:
        """Make RBAC refuse ``verb`` on ``resource`` (``pods``, ``pods/exec``, ``sandboxclaims`` ...)."""
        self.denied.add((verb, resource))

    def pods(self, namespace: str | None = None, labels: str = "") -> list[Obj]:
        return [self.kubelet.refresh(p) for p in self.store.list("pods", namespace, labels)]

    def container_of(self, namespace: str, name: str) -> str | None:
        pod = self.store.get("pods", namespace, name)
        return self.kubelet.containers.get(pod["metadata"]["uid"])

    # -- helpers for handlers ------------------------------------------------------------
    def authorize(self, request: web.Request, verb: str, resource: str, namespace: str, name: str = "") -> None:
        if (verb, resource) not in self.denied:
            return
        base = resource.partition("/")[0]
        group = CRDS[base][0] if base in CRDS else ""
        what = f'{base} "{name}"' if name else base
        where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
        message = f'{what} is forbidden: User "{USER}" cannot {verb} resource "{resource}" in API group "{group}"{where}'
        raise ApiError(status(403, "Forbidden", message, kind=base, name=name or None))

    def get_pod(self, namespace: str, name: str) -> Obj:
        return self.kubelet.refresh(self.store.get("pods", namespace, name))

    def _need_namespace(self, namespace: str) -> None:
        if self.store.peek("namespaces", "", namespace) is None:
            raise not_found("namespaces", namespace)

    # -- HTTP ---------------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        try:
            if request.headers.get("Authorization", "") != f"Bearer {self.token}":
                raise ApiError(status(401, "Unauthorized", "Unauthorized"))
            result = await self._route(request)
            if isinstance(result, web.StreamResponse):
                return result
            code, body = result
            return web.json_response(body, status=code)
        except ApiError as exc:
            return web.json_response(exc.body, status=exc.code)

    async def _route(self, request: web.Request) -> Any:
        parts = [p for p in request.path.split("/") if p]
        method = request.method
        if parts == ["version"]:
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-hermes-emulator", "gitCommit": "0" * 40,
                         "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24.0",
                         "compiler": "gc", "platform": "linux/amd64"}
        if parts[:2] == ["api", "v1"]:
            rest = parts[2:]
            if rest[:1] == ["namespaces"] and len(rest) >= 3:
                ns, resource, tail = rest[1], rest[2], rest[3:]
                return await self._core(request, method, ns, resource, tail)
            if rest == ["namespaces"] or (rest[:1] == ["namespaces"] and len(rest) == 2):
                return await self._namespaces(request, method, rest[1] if len(rest) == 2 else None)
            if len(rest) == 1 and rest[0] in ("pods", "events"):
                self.authorize(request, "list", rest[0], "")
                return 200, self._list_body(rest[0], None, request)
        if parts[:1] == ["apis"] and len(parts) >= 6 and parts[3] == "namespaces":
            group, version, ns, plural, tail = parts[1], parts[2], parts[4], parts[5], parts[6:]
            if CRDS.get(plural, ("",))[0] == group:
                return await self.sandboxes.handle(request, method, version, ns, plural, tail)
        raise ApiError(status(404, "NotFound", "the server could not find the requested resource"))

    def _list_body(self, resource: str, ns: str | None, request: web.Request) -> Obj:
        items = self.store.list(resource, ns, request.query.get("labelSelector", ""), request.query.get("fieldSelector", ""))
        if resource == "pods":
            items = [self.kubelet.refresh(p) for p in items]
        kind = {"pods": "PodList", "events": "EventList", "namespaces": "NamespaceList"}[resource]
        return {"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": self.store.resource_version},
                "items": items}

    async def _namespaces(self, request: web.Request, method: str, name: str | None) -> Any:
        if method == "GET" and name is None:
            self.authorize(request, "list", "namespaces", "")
            return 200, self._list_body("namespaces", "", request)
        if method == "GET":
            self.authorize(request, "get", "namespaces", "", name or "")
            return 200, self.store.get("namespaces", "", name or "")
        if method == "POST" and name is None:
            self.authorize(request, "create", "namespaces", "")
            body = await request.json()
            body.setdefault("status", {"phase": "Active"})
            return 201, self.store.create("namespaces", "", body)
        if method == "DELETE" and name:
            self.authorize(request, "delete", "namespaces", "", name)
            obj = self.store.remove("namespaces", "", name)
            if obj is None:
                raise not_found("namespaces", name)
            for pod in self.store.list("pods", name):
                self.kubelet.delete(pod, 0)
            return 200, obj
        raise ApiError(status(405, "MethodNotAllowed", f"{method} is not supported on namespaces"))

    async def _core(self, request: web.Request, method: str, ns: str, resource: str, tail: list[str]) -> Any:
        if resource == "pods" and tail[1:] == ["exec"]:
            return await execws.handle_exec(self, request, ns, tail[0])
        if resource not in ("pods", "events") or len(tail) > 1:
            raise ApiError(status(404, "NotFound", "the server could not find the requested resource"))
        name = tail[0] if tail else ""
        if method == "GET" and not name:
            self.authorize(request, "list", resource, ns)
            return 200, self._list_body(resource, ns, request)
        if method == "GET":
            self.authorize(request, "get", resource, ns, name)
            return 200, (self.get_pod(ns, name) if resource == "pods" else self.store.get(resource, ns, name))
        if method == "POST" and not name and resource == "pods":
            self.authorize(request, "create", "pods", ns)
            self._need_namespace(ns)
            return 201, self.create_pod(ns, await request.json())
        if method == "DELETE" and name and resource == "pods":
            self.authorize(request, "delete", "pods", ns, name)
            grace = request.query.get("gracePeriodSeconds")
            if grace is None and request.can_read_body:
                body = await request.json()
                grace = (body or {}).get("gracePeriodSeconds")
            return 200, self.delete_pod(ns, name, None if grace is None else int(grace))
        raise ApiError(status(405, "MethodNotAllowed", f"{method} is not supported here"))

    # -- pods -----------------------------------------------------------------------------------
    def create_pod(self, ns: str, body: Obj) -> Obj:
        spec = body.get("spec") or {}
        name = (body.get("metadata") or {}).get("name") or ""
        containers = spec.get("containers") or []
        if not containers:
            raise invalid("Pod", name, "spec.containers: Required value")
        for i, c in enumerate(containers):
            if not c.get("image"):
                raise invalid("Pod", name, f"spec.containers[{i}].image: Required value")
            if not c.get("name"):
                raise invalid("Pod", name, f"spec.containers[{i}].name: Required value")
        rc = spec.get("runtimeClassName")
        if rc and rc not in self.runtime_classes:
            raise ApiError(status(403, "Forbidden", f'pods "{name}" is forbidden: pod rejected: RuntimeClass "{rc}" not found',
                                  kind="pods", name=name))
        body["apiVersion"], body["kind"] = "v1", "Pod"
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("serviceAccountName", "default")
        body["spec"] = spec
        body["status"] = {"phase": "Pending", "qosClass": "BestEffort", "conditions": []}
        pod = self.store.create("pods", ns, body)
        self.kubelet.start(pod)
        return pod

    def delete_pod(self, ns: str, name: str, grace: int | None) -> Obj:
        pod = self.store.get("pods", ns, name)
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))

        def mark(o: Obj) -> None:
            o["metadata"].setdefault("deletionTimestamp", now())
            o["metadata"]["deletionGracePeriodSeconds"] = grace
        pod = self.store.update("pods", ns, name, mark) or pod
        self.kubelet.delete(pod, grace)
        return pod
