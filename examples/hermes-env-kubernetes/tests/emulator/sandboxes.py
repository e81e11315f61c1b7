"""The agent-sandbox CRDs and a small controller for them (kubernetes-sigs/agent-sandbox).

Shapes from that project's Go types (``api/v1beta1/sandbox_types.go``,
``extensions/api/v1alpha1/sandboxclaim_types.go``, ``.../v1beta1/...``):

* ``SandboxTemplate`` (extensions.agents.x-k8s.io): ``spec.podTemplate.{metadata,spec}``;
* ``SandboxWarmPool``: ``spec.replicas`` pods kept ready from ``spec.sandboxTemplateRef``;
* ``SandboxClaim``: v1alpha1 ``spec.sandboxTemplateRef.name``, v1beta1 ``spec.warmPoolRef.name``;
  ``status.sandbox.name`` names its Sandbox; a ``Ready`` condition mirrors the Sandbox's;
* ``Sandbox`` (agents.x-k8s.io): ``status.conditions[Ready]`` true once its pod runs;
  a pod adopted from a warm pool is named by the annotation ``agents.x-k8s.io/pod-name``.

Deleting a claim deletes its Sandbox and pod, as the owner references do there.
Status is computed when an object is read, from its pod.
"""

from __future__ import annotations

import copy
import secrets
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .store import ApiError, Obj, not_found, now, status

if TYPE_CHECKING:
    from .server import KubeEmulator

EXT, CORE = "extensions.agents.x-k8s.io", "agents.x-k8s.io"
#: plural -> (API group, kind)
CRDS = {
    "sandboxtemplates": (EXT, "SandboxTemplate"),
    "sandboxwarmpools": (EXT, "SandboxWarmPool"),
    "sandboxclaims": (EXT, "SandboxClaim"),
    "sandboxes": (CORE, "Sandbox"),
}
POD_NAME = "agents.x-k8s.io/pod-name"
POOL_LABEL = "agents.x-k8s.io/warm-pool"
VERSIONS = ("v1alpha1", "v1beta1")


def _cond(type_: str, ok: bool, reason: str, message: str = "") -> Obj:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message,
            "lastTransitionTime": now()}


class SandboxController:
    def __init__(self, emu: KubeEmulator) -> None:
        self.emu = emu

    async def handle(self, request: web.Request, method: str, version: str, ns: str, plural: str,
                     tail: list[str]) -> Any:
        if version not in VERSIONS:
            raise ApiError(status(404, "NotFound", "the server could not find the requested resource"))
        emu, store = self.emu, self.emu.store
        name = tail[0] if tail else ""
        if method == "GET" and not name:
            emu.authorize(request, "list", plural, ns)
            items = [self._refresh(plural, o) for o in store.list(plural, ns, request.query.get("labelSelector", ""))]
            return 200, {"apiVersion": f"{CRDS[plural][0]}/{version}", "kind": CRDS[plural][1] + "List",
                         "metadata": {"resourceVersion": store.resource_version}, "items": items}
        if method == "GET":
            emu.authorize(request, "get", plural, ns, name)
            return 200, self._refresh(plural, store.get(plural, ns, name))
        if method == "POST" and not name:
            emu.authorize(request, "create", plural, ns)
            if store.peek("namespaces", "", ns) is None:
                raise not_found("namespaces", ns)
            body = await request.json()
            body.setdefault("status", {})
            obj = store.create(plural, ns, body)
            self._created(plural, ns, obj)
            return 201, obj
        if method == "DELETE" and name:
            emu.authorize(request, "delete", plural, ns, name)
            obj = store.remove(plural, ns, name)
            if obj is None:
                raise not_found(f"{plural}.{CRDS[plural][0]}", name)
            self._deleted(plural, ns, obj)
            return 200, obj
        raise ApiError(status(405, "MethodNotAllowed", f"{method} is not supported here"))

    # -- reconcile ----------------------------------------------------------------------
    def _pod_from_template(self, ns: str, template: str, pod_name: str, labels: dict[str, str]) -> str | None:
        tmpl = self.emu.store.peek("sandboxtemplates", ns, template)
        if tmpl is None:
            return f'SandboxTemplate "{template}" not found'
        pt = copy.deepcopy(tmpl["spec"].get("podTemplate") or {})
        meta = {"name": pod_name, "labels": {**(pt.get("metadata") or {}).get("labels", {}), **labels}}
        spec = pt.get("spec") or {}
        spec.setdefault("restartPolicy", "Never")
        try:
            self.emu.create_pod(ns, {"metadata": meta, "spec": spec})
        except ApiError as exc:
            return str(exc)
        return None

    def _created(self, plural: str, ns: str, obj: Obj) -> None:
        store, name = self.emu.store, obj["metadata"]["name"]
        if plural == "sandboxwarmpools":
            template = (obj["spec"].get("sandboxTemplateRef") or {}).get("name", "")
            for _ in range(int(obj["spec"].get("replicas", 1))):
                self._pod_from_template(ns, template, f"{name}-{secrets.token_hex(3)}", {POOL_LABEL: name})
        elif plural == "sandboxes":
            pt = obj["spec"].get("podTemplate") or {}
            self.emu.create_pod(ns, {"metadata": {"name": name, "labels": (pt.get("metadata") or {}).get("labels", {})},
                                     "spec": copy.deepcopy(pt.get("spec") or {})})
        elif plural == "sandboxclaims":
            spec = obj["spec"]
            pool = (spec.get("warmPoolRef") or {}).get("name")
            template = (spec.get("sandboxTemplateRef") or {}).get("name")
            labels = {"agents.x-k8s.io/claim": name, **((spec.get("additionalPodMetadata") or {}).get("labels") or {})}
            error, pod_name = None, name
            if pool:
                wp = store.peek("sandboxwarmpools", ns, pool)
                if wp is None:
                    error = f'SandboxWarmPool "{pool}" not found'
                else:
                    template = (wp["spec"].get("sandboxTemplateRef") or {}).get("name", "")
                    warm = [p for p in self.emu.pods(ns, f"{POOL_LABEL}={pool}") if p["status"].get("phase") == "Running"]
                    if warm:  # adopt a warm pod, then top the pool up again
                        pod_name = warm[0]["metadata"]["name"]
                        store.update("pods", ns, pod_name, lambda o: (o["metadata"]["labels"].pop(POOL_LABEL, None),
                                                                      o["metadata"]["labels"].update(labels)))
                        self._pod_from_template(ns, template, f"{pool}-{secrets.token_hex(3)}", {POOL_LABEL: pool})
                    else:
                        error = self._pod_from_template(ns, template, name, labels)
            elif template:
                error = self._pod_from_template(ns, template, name, labels)
            else:
                error = "spec.sandboxTemplateRef.name or spec.warmPoolRef.name is required"
            if error is None:
                sandbox = {"apiVersion": f"{CORE}/v1alpha1", "kind": "Sandbox",
                           "metadata": {"name": name, "annotations": {POD_NAME: pod_name},
                                        "ownerReferences": [{"kind": "SandboxClaim", "name": name,
                                                             "uid": obj["metadata"]["uid"]}]},
                           "spec": {"podTemplate": {}}, "status": {}}
                store.create("sandboxes", ns, sandbox)
                store.update(plural, ns, name, lambda o: o["status"].update(sandbox={"name": name}))
            else:
                store.update(plural, ns, name, lambda o: o["status"].update(
                    conditions=[_cond("Ready", False, "ReconcilerError", error)]))

    def _deleted(self, plural: str, ns: str, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        if plural == "sandboxclaims":
            sandbox = self.emu.store.remove("sandboxes", ns, name)
            if sandbox is not None:
                self._deleted("sandboxes", ns, sandbox)
        elif plural == "sandboxes":
            pod = (obj["metadata"].get("annotations") or {}).get(POD_NAME, name)
            if self.emu.store.peek("pods", ns, pod) is not None:
                self.emu.delete_pod(ns, pod, 0)

    def _refresh(self, plural: str, obj: Obj) -> Obj:
        """Ready follows the pod: computed on read."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        if plural == "sandboxclaims" and (obj["status"].get("sandbox") or {}).get("name"):
            sandbox = self.emu.store.peek("sandboxes", ns, obj["status"]["sandbox"]["name"])
            ready = sandbox is not None and self._pod_ready(ns, sandbox)
            obj["status"]["conditions"] = [_cond("Ready", ready, "SandboxReady" if ready else "SandboxNotReady")]
        elif plural == "sandboxes":
            ready = self._pod_ready(ns, obj)
            obj["status"]["conditions"] = [_cond("Ready", ready, "DependenciesReady" if ready else "DependenciesNotReady")]
            obj["status"]["selector"] = f"agents.x-k8s.io/sandbox-name-hash={name}"
        return obj

    def _pod_ready(self, ns: str, sandbox: Obj) -> bool:
        pod_name = (sandbox["metadata"].get("annotations") or {}).get(POD_NAME, sandbox["metadata"]["name"])
        try:
            pod = self.emu.get_pod(ns, pod_name)
        except ApiError:
            return False
        return pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")
