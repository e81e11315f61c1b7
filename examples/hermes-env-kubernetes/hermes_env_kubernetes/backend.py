"""The ``kubernetes`` backend: one pod per environment, each command an exec over websocket.

The official ``kubernetes`` client is imported here only, when an environment
is created. The pod is made on first use and deleted at close.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import select
import shlex
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from hermes_env_core.config import memory_bytes
from hermes_env_core.environment.handles import ProcessHandle
from hermes_env_core.environment.session import KILL_TREE_FN
from hermes_env_core.environment.target import RunRequest, TargetEnvironment
from hermes_env_core.errors import BackendError, EnvironmentUnavailable, HermesEnvError
from hermes_env_core.sync import CommandFailedError, CommandTransport, SyncEngine

from .config import KubernetesConfig

MANAGED = {"app.kubernetes.io/managed-by": "hermes-env"}
EXT, CORE = ("extensions.agents.x-k8s.io", "v1alpha1"), ("agents.x-k8s.io", "v1alpha1")
RBAC = "pods: create, get, list, delete; pods/exec: get, create; events: list"
_LINGER_S = 0.5  # after bash reported, how long a background child may hold the stream
# The script never goes in the exec URL (apiserver audit logs, /proc/*/cmdline): it is read from
# the exec's stdin by length, then the command's stdin follows (bounded too on v4, which cannot half-close).
# Then a new `bash -c` runs it (a script past the argv limit: as its script file). The exported
# nonce marks every process of the command, even one that left the tree (setsid, re-parented).
_PRELUDE = ('__hermes_src=$(head -c "$1"; printf x); [[ $2 == - ]] || exec < <(head -c "$2")\n'
            'export __hermes_exec=$3; (( ${#__hermes_src} < 60000 )) && exec bash $4 -c "${__hermes_src%x}" bash\n'
            'exec bash $4 <(builtin printf %s "${__hermes_src%x}")')
_FIND = ('m=__hermes_exec={0}; for p in /proc/[0-9]*; do mapfile -d "" -t e <"$p/environ" || continue; '
         '[[ " ${{e[*]}} " == *" $m "* ]] && __hermes_kill_tree {1} "${{p#/proc/}}"; done 2>/dev/null; true')

_reaped: set[str] = set()


def _k8s() -> Any:
    try:
        import kubernetes
    except ImportError as exc:
        raise EnvironmentUnavailable("kubernetes backend needs the kubernetes client: pip install kubernetes") from exc
    return kubernetes


def _label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.") or "x"


def _owner() -> dict[str, str]:
    import psutil

    return {"hermes-env/owner-host": _label(socket.gethostname()), "hermes-env/owner-pid": str(os.getpid()),
            "hermes-env/owner-start": str(int(psutil.Process().create_time()))}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _wait_io(ws: Any, write: bool, timeout: float | None) -> bool:
    """Wait, without holding the lock, until the socket is ready (TLS: read and write never overlap)."""
    sock = ws.sock.sock
    if not write and getattr(sock, "pending", lambda: 0)():
        return True
    r, w, _ = select.select([] if write else [sock], [sock] if write else [], [], timeout)
    return bool(r or w)


def _recv(ws: Any, lock: threading.Lock, keepalive: float) -> tuple[int, Any]:
    """The next websocket frame; a ping after ``keepalive`` seconds of quiet."""
    while not _wait_io(ws, False, keepalive):
        with lock:
            ws.sock.ping()
    with lock:
        return ws.sock.recv_data_frame(True)  # type: ignore[no-any-return]


def _send(ws: Any, lock: threading.Lock, channel: int, data: bytes) -> None:
    for i in range(0, max(len(data), 1), 16384):
        _wait_io(ws, True, None)
        with lock:
            ws.write_channel(channel, data[i:i + 16384])


class _Exec:
    """One exec websocket as a process: channels 1 and 2 into a pipe, the exit code from channel 3."""

    def __init__(self, ws: Any, stdin: bytes | None, keepalive: float, v5: bool, merge: bool = True) -> None:
        r, self._w = os.pipe()
        self.stdout = os.fdopen(r, "rb", buffering=0)
        self.ws, self.returncode, self.error, self.killer, self.killed = ws, None, None, None, False
        self.stderr, self._merge, self._code = b"", merge, 0
        self._done, self._send = threading.Event(), threading.Lock()
        self._keepalive = keepalive
        ws.sock.settimeout(None)
        threading.Thread(target=self._pump, daemon=True).start()
        if stdin is not None:
            threading.Thread(target=self._feed, args=(stdin, v5), daemon=True).start()

    def _feed(self, data: bytes, v5: bool) -> None:
        try:
            if data:
                _send(self.ws, self._send, 0, data)
            if v5:
                with self._send:
                    self.ws.close_channel(0)
        except Exception:  # noqa: BLE001, S110 - the command exited without reading it all
            pass

    def _pump(self) -> None:
        from websocket import ABNF

        try:
            while True:
                op, frame = _recv(self.ws, self._send, self._keepalive)
                if op == ABNF.OPCODE_CLOSE:
                    break
                data = frame.data if op in (ABNF.OPCODE_BINARY, ABNF.OPCODE_TEXT) else b""
                if data[:1] == b"\x01" or (data[:1] == b"\x02" and self._merge):
                    os.write(self._w, data[1:]) if len(data) > 1 else None
                elif data[:1] == b"\x02":
                    self.stderr += data[1:]
                elif data[:1] == b"\x03":
                    st = json.loads(data[1:])
                    if st.get("status") != "Success":
                        causes = (st.get("details") or {}).get("causes") or [{}]
                        if st.get("reason") != "NonZeroExitCode":
                            raise BackendError(f"kubernetes: exec failed: {st.get('message')}")
                        self._code = int(causes[0].get("message", 1))
        except Exception as exc:  # noqa: BLE001 - surfaced by wait()
            if self.returncode is None:
                self.error = exc
        finally:
            os.close(self._w)
            self._done.set()

    def poll(self) -> int | None:
        return self.wait(0) if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(_LINGER_S if timeout is None else min(timeout, _LINGER_S)):
            if timeout is not None and timeout <= _LINGER_S:
                raise TimeoutError("command still running")
            # bash has reported (the base waits only then); a background child holds the stream.
            self.returncode = self._code
            self.ws.close()
        if self.error is not None and self.returncode is None and not self.killed:
            raise BackendError(f"kubernetes: lost the exec stream: {self.error!r}") from self.error
        self.returncode = self._code
        return self._code

    def terminate(self) -> None:
        self.killed = True  # the stream may break as the tree dies: no transport error then
        self.killer(True) if self.killer else None

    def kill(self) -> None:
        self.killed = True
        self.killer(False) if self.killer else self.ws.close()


class _Channel:
    """One exec websocket as the core's resident channel: stdin in, channel 1 out, the rest dropped."""

    def __init__(self, ws: Any, keepalive: float) -> None:
        self.ws, self._buf, self._lock, self._keepalive = ws, b"", threading.Lock(), keepalive
        ws.sock.settimeout(None)

    def read(self, n: int) -> bytes:
        from websocket import ABNF

        try:
            while not self._buf:
                op, frame = _recv(self.ws, self._lock, self._keepalive)
                if op == ABNF.OPCODE_CLOSE or (op == ABNF.OPCODE_BINARY and frame.data[:1] == b"\x03"):
                    return b""
                if op in (ABNF.OPCODE_BINARY, ABNF.OPCODE_TEXT) and frame.data[:1] == b"\x01":
                    self._buf = frame.data[1:]
        except Exception:  # noqa: BLE001 - any failure is the end of the stream
            return b""
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def write(self, data: bytes) -> None:
        try:
            _send(self.ws, self._lock, 0, data)
        except Exception as exc:
            raise OSError(f"kubernetes: the channel's exec stream is broken: {exc}") from exc

    def close(self) -> None:
        self.ws.close()


class PodTarget:
    """The ``Target``: a pod (or an agent-sandbox claim's pod) reached through the exec API."""

    def __init__(self, config: KubernetesConfig, task_id: str, note: Any, on_recreate: Any) -> None:
        self.config, self.task_id, self._note, self._on_recreate = config, task_id, note, on_recreate
        self._k8s = k8s = _k8s()
        cfg, conf = self.config, k8s.client.Configuration()
        path = cfg.kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        ns = "default"
        try:
            if cfg.kubeconfig or os.environ.get("KUBECONFIG") or os.path.exists(path):
                k8s.config.load_kube_config(config_file=path, context=cfg.context, client_configuration=conf)
                ctx = k8s.config.list_kube_config_contexts(path)
                ctx = next(c for c in ctx[0] if c["name"] == cfg.context) if cfg.context else ctx[1]
                ns = ctx["context"].get("namespace", ns)
            else:
                k8s.config.load_incluster_config(client_configuration=conf)
                with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                    ns = f.read().strip()
        except Exception as exc:
            raise EnvironmentUnavailable(f"kubernetes: cannot load a cluster configuration from {path} "
                                         f"(nor in-cluster): {exc}") from exc
        self.namespace = cfg.namespace or ns
        self._core = k8s.client.CoreV1Api(k8s.client.ApiClient(conf))
        self._exec_api = k8s.client.CoreV1Api(k8s.client.ApiClient(conf))  # stream() patches its client
        self._custom = k8s.client.CustomObjectsApi(self._core.api_client)
        self._exec_lock, self._lock = threading.Lock(), threading.Lock()
        self.pod_name: str | None = None
        self.claim_name: str | None = None
        self._v5: bool | None = None  # learnt from the first exec

    # -- errors ------------------------------------------------------------------------------
    def _error(self, exc: Exception, doing: str) -> EnvironmentUnavailable:
        code, text = getattr(exc, "status", 0), str(getattr(exc, "body", "") or getattr(exc, "reason", "") or exc)
        if m := re.search(r"Handshake status (\d+).*-\+-\+- (.*)$", text, re.S):  # the exec handshake was refused
            code, text = int(m.group(1)), m.group(2)
            if text[:2] in ("b'", 'b"'):  # older websocket-client versions show the body's bytes
                text = ast.literal_eval(text).decode("utf-8", "replace")
        try:
            text = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            pass
        hint = f"; the account needs RBAC verbs {RBAC}" if code == 403 else ""
        if code == 403 and (self.config.sandbox_template or self.config.sandbox_warm_pool):
            hint += ", sandboxclaims: create, get, delete; sandboxes: get"
        return EnvironmentUnavailable(f"kubernetes: cannot {doing} in namespace {self.namespace!r}: {text}{hint}")

    # -- the pod ----------------------------------------------------------------------------------
    def _manifest(self, name: str) -> dict[str, Any]:
        cfg = self.config
        memory = str(memory_bytes(cfg.memory)) if cfg.memory else None  # "512m" is ours; Kubernetes reads bytes
        cpu = f"{cfg.cpu:g}" if cfg.cpu else None
        res = {k: v for k, v in (("cpu", cpu), ("memory", memory), ("ephemeral-storage", cfg.ephemeral_storage)) if v}
        spec: dict[str, Any] = {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 2, "nodeSelector": cfg.node_selector or None,
            "tolerations": list(cfg.tolerations) or None, "runtimeClassName": cfg.runtime_class,
            "serviceAccountName": cfg.service_account, "automountServiceAccountToken": bool(cfg.service_account),
            "imagePullSecrets": [{"name": s} for s in cfg.image_pull_secrets] or None,
            "containers": [{"name": "main", "image": cfg.image,
                            "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep infinity & wait"],
                            "env": [{"name": k, "value": v} for k, v in cfg.env.items()] or None,
                            "resources": {"requests": res, "limits": res} if res else None}],
        }
        labels = {**cfg.labels, **MANAGED, **_owner(), "hermes-env/task": _label(self.task_id)}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
               "spec": {k: v for k, v in spec.items() if v is not None}}
        return _merge(pod, cfg.pod_overlay)

    def _pod(self) -> str:
        with self._lock:
            if self.pod_name is None:
                self._reap_orphans()
                name = f"hermes-{_label(self.task_id.lower())[:40]}-{secrets.token_hex(3)}"
                try:
                    if self.config.sandbox_template or self.config.sandbox_warm_pool:
                        self.pod_name = self._claim(name)
                    else:
                        self._core.create_namespaced_pod(self.namespace, self._manifest(name))
                        self.pod_name = name
                    self._wait_running(self.pod_name)
                except self._k8s.client.ApiException as exc:
                    self._release()
                    raise self._error(exc, f"create pod {name}") from exc
                except BaseException:
                    self._release()
                    raise
            return self.pod_name

    def _claim(self, name: str) -> str:
        cfg = self.config
        ref = {"sandboxTemplateRef": {"name": cfg.sandbox_template}} if cfg.sandbox_template else {
            "warmPoolRef": {"name": cfg.sandbox_warm_pool}}
        claim = {"apiVersion": f"{EXT[0]}/{'v1alpha1' if cfg.sandbox_template else 'v1beta1'}", "kind": "SandboxClaim",
                 "metadata": {"name": name, "labels": {**MANAGED, **_owner()}}, "spec": ref}
        version = claim["apiVersion"].split("/")[1]
        try:
            self._custom.create_namespaced_custom_object(EXT[0], version, self.namespace, "sandboxclaims", claim)
            self.claim_name = name
            deadline = time.monotonic() + cfg.start_timeout
            while time.monotonic() < deadline:
                got = self._custom.get_namespaced_custom_object(EXT[0], version, self.namespace, "sandboxclaims", name)
                st = got.get("status") or {}
                bad = [c for c in st.get("conditions") or [] if c.get("reason") == "ReconcilerError"]
                if bad:
                    raise EnvironmentUnavailable(f"kubernetes: SandboxClaim {name}: {bad[0].get('message')}")
                if (st.get("sandbox") or {}).get("name"):
                    sb = self._custom.get_namespaced_custom_object(
                        CORE[0], CORE[1], self.namespace, "sandboxes", st["sandbox"]["name"])
                    return str((sb["metadata"].get("annotations") or {}).get("agents.x-k8s.io/pod-name", sb["metadata"]["name"]))
                time.sleep(0.1)
        except self._k8s.client.ApiException as exc:
            raise self._error(exc, "claim a sandbox") from exc
        raise EnvironmentUnavailable(f"kubernetes: SandboxClaim {name} got no Sandbox within {cfg.start_timeout:g}s")

    def _wait_running(self, name: str) -> None:
        deadline, phase = time.monotonic() + self.config.start_timeout, "?"
        while time.monotonic() < deadline:
            try:
                pod = self._core.read_namespaced_pod(name, self.namespace)
            except self._k8s.client.ApiException as exc:
                raise self._error(exc, f"create or read pod {name}") from exc
            phase = pod.status.phase
            if phase == "Running":
                return
            waiting = [cs.state.waiting for cs in pod.status.container_statuses or [] if cs.state and cs.state.waiting]
            unsched = [c for c in pod.status.conditions or [] if c.reason == "Unschedulable"]
            if phase in ("Failed", "Succeeded") or unsched or any(
                    w.reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName") for w in waiting):
                raise EnvironmentUnavailable(f"kubernetes: pod {name} cannot start ({phase}): {self._why(name, pod)}")
            time.sleep(0.1)
        raise EnvironmentUnavailable(f"kubernetes: pod {name} not Running after {self.config.start_timeout:g}s "
                                     f"(phase {phase}): {self._why(name, None)}")

    def _why(self, name: str, pod: Any) -> str:
        try:
            events = self._core.list_namespaced_event(self.namespace, field_selector=f"involvedObject.name={name}").items
        except self._k8s.client.ApiException:
            events = []  # events are a diagnosis only
        warn = [f"{e.reason}: {e.message}" for e in events if e.type == "Warning" and "Error: " not in (e.message or "")]
        unsched = [c.message for c in (pod.status.conditions or [] if pod else []) if c.reason == "Unschedulable"]
        return "; ".join(dict.fromkeys(warn + unsched)) or "no warning events"

    def _reap_orphans(self) -> None:
        """Delete pods and claims of this host whose owner process is gone (once per namespace)."""
        import psutil

        if self.namespace in _reaped:
            return
        _reaped.add(self.namespace)
        me = _owner()["hermes-env/owner-host"]
        sel = f"app.kubernetes.io/managed-by=hermes-env,hermes-env/owner-host={me}"
        try:
            pods = [(p.metadata.name, p.metadata.labels) for p in self._core.list_namespaced_pod(self.namespace, label_selector=sel).items]
        except self._k8s.client.ApiException as exc:
            raise self._error(exc, "list pods") from exc
        for name, labels in pods:
            pid, start = int(labels.get("hermes-env/owner-pid", 0)), labels.get("hermes-env/owner-start")
            try:
                alive = str(int(psutil.Process(pid).create_time())) == start
            except psutil.Error:
                alive = False
            if not alive:
                self._delete_pod(name)

    def _delete_pod(self, name: str) -> None:
        try:
            self._core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        except self._k8s.client.ApiException as exc:
            if exc.status != 404:
                raise self._error(exc, f"delete pod {name}") from exc

    def _release(self) -> None:
        pod, claim, self.pod_name, self.claim_name = self.pod_name, self.claim_name, None, None
        if claim is not None:
            version = "v1alpha1" if self.config.sandbox_template else "v1beta1"
            try:
                self._custom.delete_namespaced_custom_object(EXT[0], version, self.namespace, "sandboxclaims", claim)
            except self._k8s.client.ApiException as exc:
                if exc.status != 404:
                    raise self._error(exc, f"delete SandboxClaim {claim}") from exc
        elif pod is not None:
            self._delete_pod(pod)

    def _lost(self, name: str) -> bool:
        """Whether the pod is gone for good (deleted, or its container ended)."""
        try:
            pod = self._core.read_namespaced_pod(name, self.namespace)
        except self._k8s.client.ApiException as exc:
            return exc.status == 404
        return pod.status.phase in ("Failed", "Succeeded") or pod.metadata.deletion_timestamp is not None

    # -- exec ----------------------------------------------------------------------------------
    def exec(self, script: str, stdin: bytes | None, *, login: bool = False, merge: bool = True,
             command: bool = False) -> _Exec:
        data = script.encode("utf-8", "surrogateescape")
        nonce = secrets.token_hex(8)
        for attempt in range(2):
            pod = self._pod()
            argv = ["bash", "-c", _PRELUDE, "bash", str(len(data)), "-" if self._v5 else str(len(stdin or b"")), nonce]
            argv += ["-l"] if login else []
            feed = data + (stdin or b"")
            try:
                with self._exec_lock:
                    ws = self._k8s.stream.stream(
                        self._exec_api.connect_get_namespaced_pod_exec, pod, self.namespace, command=argv,
                        stdin=True, stdout=True, stderr=True, tty=False, _preload_content=False, binary=True)
            except self._k8s.client.ApiException as exc:
                if attempt or not self._lost(pod):
                    raise self._error(exc, f"exec in pod {pod}") from exc
                with self._lock:
                    if self.pod_name == pod:
                        self._release()
                self._note(f"environment recreated: pod {pod} was gone; a new pod was started and the shell state "
                           "restored (files written before are lost)")
                self._on_recreate(command)
                continue
            self._v5 = ws.subprotocol == "v5.channel.k8s.io"
            handle = _Exec(ws, feed, self.config.keepalive_s, self._v5, merge)
            if command:
                handle.killer = lambda graceful: self._kill(nonce, graceful)
            return handle
        raise AssertionError("unreachable")

    def open_channel(self, argv: Sequence[str]) -> _Channel:
        """The core's resident channel (when the core offers one): a long-lived exec with stdin."""
        try:
            pod = self._pod()
            with self._exec_lock:
                ws = self._k8s.stream.stream(
                    self._exec_api.connect_get_namespaced_pod_exec, pod, self.namespace, command=list(argv),
                    stdin=True, stdout=True, stderr=True, tty=False, _preload_content=False, binary=True)
        except self._k8s.client.ApiException as exc:
            raise self._error(exc, "open a channel") from exc
        return _Channel(ws, self.config.keepalive_s)

    def helper(self, script: str, stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
        """Run ``script`` outside the session: (exit code, stdout, stderr)."""
        h = self.exec(script, stdin, merge=False)
        out = h.stdout.read()
        h._done.wait(30)
        return h.wait(5), out, h.stderr

    def _kill(self, nonce: str, graceful: bool) -> None:
        """Signal every process of the command in the pod, found by the nonce in its environment."""
        try:
            self.helper(KILL_TREE_FN + _FIND.format(nonce, "TERM" if graceful else "KILL"))
        except HermesEnvError:
            pass  # the pod is gone, and the command with it

    # -- the Target protocol ------------------------------------------------------------
    def start(self, request: RunRequest) -> ProcessHandle:
        return self.exec(request.script, request.stdin, login=request.login, command=True)

    def run_helper(self, script: str, *, timeout: float) -> tuple[int, bytes]:
        code, out, err = self.helper(script)
        return code, out + err

    def state_dir(self) -> str:
        return "/tmp"

    def recover(self, why: str) -> bool:
        with self._lock:
            self._release()  # the next command starts a new pod
        return True

    def release(self) -> None:
        with self._lock:
            self._release()


class KubernetesEnvironment(TargetEnvironment[KubernetesConfig]):
    """Runs commands in a pod (or an agent-sandbox claim) made for this environment."""

    name = "kubernetes"
    # Still on the resident channel of API 1.x: its pod recovery goes through start(); moving it
    # onto the session server (recovery when open_channel finds the pod gone) is the next step.
    session_server = False
    config_model = KubernetesConfig

    def __init__(self, config: KubernetesConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._sync: SyncEngine | None = None
        if self.config.sync:
            mappings = [s.mapping() for s in self.config.sync]
            self._sync = SyncEngine(CommandTransport(self._sync_run), mappings, interval=self.config.sync_interval_s)
        self.target  # noqa: B018 - loads the cluster configuration now; the pod comes with the first command

    def make_target(self, config: KubernetesConfig) -> PodTarget:
        return PodTarget(config, self.task_id, self._note, self._recreated)

    @property
    def pod(self) -> PodTarget:
        return self.target  # type: ignore[return-value]

    @property
    def namespace(self) -> str:
        return self.pod.namespace

    @property
    def pod_name(self) -> str | None:
        return self.pod.pod_name

    @property
    def claim_name(self) -> str | None:
        return self.pod.claim_name

    def _open_channel(self, argv: Sequence[str]) -> _Channel:
        """The core's resident channel: one long-lived exec with stdin."""
        return self.pod.open_channel(argv)

    def _recreated(self, command: bool) -> None:
        if self._sync is not None:
            self._sync.reset()  # the new pod gets every file again, before the command
            if command:
                self._sync.push(force=True)

    # -- files ---------------------------------------------------------------------------------
    def _sync_run(self, script: str, stdin: Any) -> bytes:
        code, out, err = self.pod.helper(script, stdin if isinstance(stdin, bytes) else (stdin or b""))
        if code != 0:
            raise CommandFailedError(script, code, err)
        return out

    @property
    def sync_engine(self) -> SyncEngine | None:
        return self._sync

    def _before_execute(self) -> None:
        if self._sync is not None:
            self._sync.push()

    def pull_files(self) -> Any:
        """Apply the pod's changes to the synced host paths now (also done at close); None without sync."""
        return self._sync.pull() if self._sync is not None and self.pod_name is not None else None

    def cleanup(self) -> None:
        try:
            if self.config.pull_on_close:
                self.pull_files()
        finally:
            super().cleanup()
