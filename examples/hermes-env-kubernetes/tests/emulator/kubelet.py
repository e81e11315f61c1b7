"""A one-node scheduler and kubelet: each pod's first container becomes a real Docker container.

What a pod goes through follows the pod lifecycle documentation
(kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/): Pending until the
scheduler binds it (``PodScheduled`` condition, ``FailedScheduling`` event with
the scheduler's "0/1 nodes are available: ..." message) and the image is there
(``ErrImagePull`` then ``ImagePullBackOff`` waiting reasons, ``Failed`` and
``BackOff`` events from the kubelet), then Running with ``Ready`` true, and
Succeeded/Failed when the container ends (restartPolicy Never). Deletion is
graceful: ``deletionTimestamp`` is set, the container gets SIGTERM, then SIGKILL
after the grace period, then the object goes away.

There is no registry here: an image that the local engine does not have
"fails to pull", as it would on a node that cannot reach its registry.
"""

from __future__ import annotations

import re
import threading
import time
from typing import TYPE_CHECKING, Any

from .store import Obj, now

if TYPE_CHECKING:
    from .server import KubeEmulator

LABEL = "hermes-env.k8s-emulator"
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text: str | int | float) -> float:
    """A resource.Quantity (``500m``, ``1.5``, ``256Mi``, ``1G``) as a number."""
    m = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(text).strip())
    if m is None:
        raise ValueError(f"quantities must match the regular expression: {text!r}")
    value, unit = float(m.group(1)), m.group(2) or ""
    return value / 1000 if unit == "m" else value * _UNITS[unit]


class Kubelet:
    def __init__(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.docker = emu.docker
        self.containers: dict[str, str] = {}  # pod uid -> container id
        self._threads: list[threading.Thread] = []

    # -- events ----------------------------------------------------------------------
    def event(self, pod: Obj, type_: str, reason: str, message: str, source: str = "kubelet") -> None:
        meta = pod["metadata"]
        ns = meta["namespace"]
        self.emu.store.create("events", ns, {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}."},
            "involvedObject": {"kind": "Pod", "namespace": ns, "name": meta["name"], "uid": meta["uid"],
                               "apiVersion": "v1"},
            "type": type_, "reason": reason, "message": message, "count": 1,
            "source": {"component": source}, "firstTimestamp": now(), "lastTimestamp": now(),
            "reportingComponent": source,
        })

    def _set(self, pod: Obj, fn: Any) -> Obj | None:
        meta = pod["metadata"]
        return self.emu.store.update("pods", meta["namespace"], meta["name"], fn)

    @staticmethod
    def _condition(obj: Obj, type_: str, value: str, reason: str = "", message: str = "") -> None:
        conds = [c for c in obj["status"].setdefault("conditions", []) if c["type"] != type_]
        cond = {"type": type_, "status": value, "lastTransitionTime": now()}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        obj["status"]["conditions"] = [*conds, cond]

    # -- a pod's life ----------------------------------------------------------------
    def start(self, pod: Obj) -> None:
        t = threading.Thread(target=self._run, args=(pod,), name=f"kubelet-{pod['metadata']['name']}", daemon=True)
        self._threads.append(t)
        t.start()

    def _unschedulable(self, spec: Obj) -> str | None:
        node = self.emu.node_labels
        wanted = spec.get("nodeSelector") or {}
        if any(node.get(k) != v for k, v in wanted.items()):
            return "1 node(s) didn't match Pod's node affinity/selector"
        tolerated = spec.get("tolerations") or []
        for taint in self.emu.node_taints:
            if not any(_tolerates(t, taint) for t in tolerated):
                return f"1 node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        cpu = sum(quantity((c.get("resources") or {}).get("requests", {}).get("cpu", 0)) for c in spec["containers"])
        if cpu > self.emu.node_cpu:
            return "1 Insufficient cpu"
        return None

    def _run(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        name = f"{meta['namespace']}/{meta['name']}"
        why = self._unschedulable(spec)
        if why is not None:
            msg = f"0/1 nodes are available: {why}. preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling."
            self._set(pod, lambda o: self._condition(o, "PodScheduled", "False", "Unschedulable", msg))
            self.event(pod, "Warning", "FailedScheduling", msg, "default-scheduler")
            return

        def bind(o: Obj) -> None:
            o["spec"]["nodeName"] = self.emu.node_name
            self._condition(o, "PodScheduled", "True")
        self._set(pod, bind)
        self.event(pod, "Normal", "Scheduled", f"Successfully assigned {name} to {self.emu.node_name}", "default-scheduler")
        if self.emu.start_delay:
            time.sleep(self.emu.start_delay)
        c = spec["containers"][0]
        image = c["image"]
        try:
            self.docker.images.get(image)
        except Exception:  # docker.errors.ImageNotFound: nowhere to pull from here
            self._pull_failed(pod, c)
            return
        self.event(pod, "Normal", "Pulled", f'Container image "{image}" already present on machine')
        try:
            cid = self._create(pod, c)
        except Exception as exc:  # noqa: BLE001 - reported like a runtime error
            msg = f"Error: failed to create containerd task: {exc}"
            self.event(pod, "Warning", "Failed", msg)
            self._set(pod, lambda o: o["status"].update(phase="Failed", reason="Error", message=msg))
            return
        self.containers[meta["uid"]] = cid
        self.event(pod, "Normal", "Created", f"Created container: {c['name']}")
        self.event(pod, "Normal", "Started", f"Started container {c['name']}")

        def running(o: Obj) -> None:
            st = o["status"]
            st.update(phase="Running", hostIP="127.0.0.1", podIP="", startTime=st.get("startTime") or now())
            for t in ("Initialized", "ContainersReady", "Ready", "PodReadyToStartContainers"):
                self._condition(o, t, "True")
            st["containerStatuses"] = [{
                "name": c["name"], "image": image, "imageID": f"docker-pullable://{image}",
                "containerID": f"docker://{cid}", "ready": True, "started": True, "restartCount": 0,
                "state": {"running": {"startedAt": now()}}, "lastState": {},
            }]
        if self._set(pod, running) is None:  # deleted while starting
            self._remove(cid, 0)

    def _pull_failed(self, pod: Obj, c: Obj) -> None:
        image = c["image"]
        detail = (f'rpc error: code = NotFound desc = failed to pull and unpack image "{image}": failed to resolve '
                  f'reference "{image}": {image}: not found')
        self.event(pod, "Normal", "Pulling", f'Pulling image "{image}"')
        self.event(pod, "Warning", "Failed", f'Failed to pull image "{image}": {detail}')
        self.event(pod, "Warning", "Failed", "Error: ErrImagePull")

        def waiting(reason: str, message: str) -> Any:
            def fn(o: Obj) -> None:
                o["status"]["containerStatuses"] = [{
                    "name": c["name"], "image": image, "imageID": "", "ready": False, "started": False,
                    "restartCount": 0, "state": {"waiting": {"reason": reason, "message": message}}, "lastState": {},
                }]
            return fn
        self._set(pod, waiting("ErrImagePull", detail))
        time.sleep(0.2)
        self.event(pod, "Normal", "BackOff", f'Back-off pulling image "{image}"')
        self.event(pod, "Warning", "Failed", "Error: ImagePullBackOff")
        self._set(pod, waiting("ImagePullBackOff", f'Back-off pulling image "{image}": ErrImagePull: {detail}'))

    def _create(self, pod: Obj, c: Obj) -> str:
        meta, spec = pod["metadata"], pod["spec"]
        limits = (c.get("resources") or {}).get("limits") or {}
        sc = {**(spec.get("securityContext") or {}), **(c.get("securityContext") or {})}
        caps = sc.get("capabilities") or {}
        user = None
        if sc.get("runAsUser") is not None:
            user = str(sc["runAsUser"]) + (f":{sc['runAsGroup']}" if sc.get("runAsGroup") is not None else "")
        kwargs: dict[str, Any] = {
            "entrypoint": c.get("command"), "command": c.get("args"),
            "environment": {e["name"]: e.get("value", "") for e in c.get("env") or []},
            "working_dir": c.get("workingDir"), "user": user, "hostname": meta["name"][:63],
            "labels": {LABEL: self.emu.id, f"{LABEL}.pod": meta["uid"]},
            "network_mode": "none", "detach": True, "pids_limit": self.emu.pids_limit,
            "cap_drop": caps.get("drop"), "cap_add": caps.get("add"),
            "security_opt": ["no-new-privileges"] if sc.get("allowPrivilegeEscalation") is False else None,
            "read_only": bool(sc.get("readOnlyRootFilesystem")),
        }
        if limits.get("memory"):
            kwargs["mem_limit"] = int(quantity(limits["memory"]))
        if limits.get("cpu"):
            kwargs["nano_cpus"] = int(quantity(limits["cpu"]) * 1e9)
        container = self.docker.containers.create(c["image"], **{k: v for k, v in kwargs.items() if v is not None})
        try:
            container.start()
        except Exception:
            container.remove(force=True)
            raise
        return str(container.id)

    # -- status of running pods ------------------------------------------------------------
    def refresh(self, pod: Obj) -> Obj:
        """Bring a Running pod's status up to date with its container (on every read)."""
        meta = pod["metadata"]
        cid = self.containers.get(meta["uid"])
        if cid is None or pod["status"].get("phase") != "Running":
            return pod
        try:
            state = self.docker.api.inspect_container(cid)["State"]
        except Exception:  # noqa: BLE001 - removed behind our back: the node lost it
            state = {"Running": False, "ExitCode": 137, "Error": "container removed"}
        if state.get("Running"):
            return pod
        code = int(state.get("ExitCode") or 0)

        def ended(o: Obj) -> None:
            o["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            for t in ("ContainersReady", "Ready"):
                self._condition(o, t, "False", "PodCompleted" if code == 0 else "PodFailed")
            for cs in o["status"].get("containerStatuses") or []:
                cs.update(ready=False, started=False, state={"terminated": {
                    "exitCode": code, "reason": "OOMKilled" if state.get("OOMKilled") else ("Completed" if code == 0 else "Error"),
                    "finishedAt": now()}})
        return self._set(pod, ended) or pod

    # -- deletion ------------------------------------------------------------------------
    def delete(self, pod: Obj, grace: int) -> None:
        cid = self.containers.pop(pod["metadata"]["uid"], None)
        if cid is not None:
            c = pod["spec"]["containers"][0]["name"]
            self.event(pod, "Normal", "Killing", f"Stopping container {c}")

        def finish() -> None:
            if cid is not None:
                self._remove(cid, grace)
            meta = pod["metadata"]
            self.emu.store.remove("pods", meta["namespace"], meta["name"])
        t = threading.Thread(target=finish, name="kubelet-delete", daemon=True)
        self._threads.append(t)
        t.start()

    def _remove(self, cid: str, grace: int) -> None:
        try:
            self.docker.api.stop(cid, timeout=max(grace, 0))
        except Exception:  # noqa: BLE001 - gone already
            pass
        try:
            self.docker.api.remove_container(cid, force=True, v=True)
        except Exception:  # noqa: BLE001
            pass

    def shutdown(self) -> None:
        for cid in list(self.containers.values()):
            self._remove(cid, 0)
        self.containers.clear()
        try:
            for c in self.docker.containers.list(all=True, filters={"label": f"{LABEL}={self.emu.id}"}):
                c.remove(force=True)
        except Exception:  # noqa: BLE001
            pass


def _tolerates(toleration: Obj, taint: Obj) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint["key"]
    return toleration.get("key") == taint["key"] and toleration.get("value", "") == taint.get("value", "")
