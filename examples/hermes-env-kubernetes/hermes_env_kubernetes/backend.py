"""The ``kubernetes`` backend: one pod per environment; the session runs in it over one exec websocket.

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
import socket
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from hermes_env_core.config import memory_bytes
from hermes_env_core.environment.session import KILL_TREE_FN
from hermes_env_core.environment.target import RunRequest, TargetEnvironment, run_to_end
from hermes_env_core.errors import BackendError, EnvironmentUnavailable, HermesEnvError, TargetLostError
from hermes_env_core.sync import CommandFailedError, CommandTransport, SyncEngine

from .config import KubernetesConfig

MANAGED = {"app.kubernetes.io/managed-by": "hermes-env"}
EXT, CORE = ("extensions.agents.x-k8s.io", "v1alpha1"), ("agents.x-k8s.io", "v1alpha1")
RBAC = "pods: create, get, list, delete; pods/exec: get, create; events: list"
_LINGER_S = 0.5  # after bash reported, how long a background child may hold a helper's stream
# A helper's script never goes in the exec URL (apiserver audit logs, /proc/*/cmdline): it is read
# from the exec's stdin by length, then its stdin, bounded too (v4 cannot half-close stdin). The
# exported nonce marks every process it starts, even one that left the tree (setsid, re-parented).
_PRELUDE = ('export __hermes_exec=$3; __hermes_src=$(head -c "$1"; printf x); exec < <(head -c "$2") 2>&$4\n'
            '(( ${#__hermes_src} < 60000 )) && exec bash $5 -c "${__hermes_src%x}" bash\n'
            'exec bash $5 <(builtin printf %s "${__hermes_src%x}")')
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


class _Stream:
    """One exec websocket as a byte stream (the core's ``ChannelStream``): stdin in, channel 1 out,
    the exit code from channel 3 at the end. Reads and writes of one TLS socket never overlap:
    each waits for readiness outside the lock and does its frame I/O inside it."""

    def __init__(self, ws: Any, keepalive: float, pod: str) -> None:
        self.ws, self._buf, self._keepalive, self.pod = ws, b"", keepalive, pod
        self.code: int | None = None  # the exit status, once the status channel said it
        self.error: str | None = None
        self.ended: float | None = None  # when the status came (wall clock)
        self.stderr = b""
        self._lock = threading.Lock()
        self.closed = False
        ws.sock.settimeout(None)

    def _ready(self, write: bool, timeout: float | None) -> bool:
        sock = self.ws.sock.sock
        if not write and getattr(sock, "pending", lambda: 0)():
            return True
        return any(select.select([] if write else [sock], [sock] if write else [], [], timeout)[:2])

    def read(self, n: int) -> bytes:
        from websocket import ABNF

        try:
            while not self._buf:
                while not self._ready(False, self._keepalive):
                    with self._lock:
                        self.ws.sock.ping()  # keeps a quiet stream open through proxies
                with self._lock:
                    op, frame = self.ws.sock.recv_data_frame(True)
                data = frame.data if op in (ABNF.OPCODE_BINARY, ABNF.OPCODE_TEXT) else b""
                if data[:1] == b"\x03":  # the status, then the server closes (and the client answers)
                    st = json.loads(data[1:])
                    causes = (st.get("details") or {}).get("causes") or [{}]
                    if st.get("status") == "Success" or st.get("reason") == "NonZeroExitCode":
                        self.code, self.ended = int(causes[0].get("message", 0)), time.time()
                    self.error = st.get("message")
                if op == ABNF.OPCODE_CLOSE:
                    self.error = None if self.code is not None else self.error or "the exec stream closed"
                    return b""
                self._buf = data[1:] if data[:1] == b"\x01" else b""
                self.stderr = (self.stderr + data[1:])[-65536:] if data[:1] == b"\x02" else self.stderr
        except Exception as exc:  # noqa: BLE001 - any failure is the end of the stream
            self.error = self.error or repr(exc)
            return b""
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def write(self, data: bytes) -> None:
        try:
            for i in range(0, len(data), 16384):
                self._ready(True, None)
                with self._lock:
                    self.ws.write_channel(0, data[i:i + 16384])
        except Exception as exc:
            raise OSError(f"kubernetes: the exec stream is broken: {exc}") from exc

    def close(self) -> None:
        self.closed = True
        self.ws.close()


class _Proc:
    """A helper process (``Target.start``) over a ``_Stream``: its output into a pipe, its exit code
    from the status channel; ``kill()`` signals every process that carries its nonce."""

    def __init__(self, stream: _Stream, feed: bytes, killer: Any) -> None:
        r, self._w = os.pipe()
        self.stdout: IO[bytes] | None = os.fdopen(r, "rb", buffering=0)
        self.returncode: int | None = None
        self.killed = False
        self._stream, self._killer, self._done = stream, killer, threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._feed, args=(feed,), daemon=True).start()

    def _feed(self, data: bytes) -> None:
        try:
            self._stream.write(data)
        except OSError:
            pass  # it exited without reading all of its stdin

    def _pump(self) -> None:
        try:
            while data := self._stream.read(65536):
                os.write(self._w, data)
        except OSError:
            pass  # nobody reads the output any more
        finally:
            os.close(self._w)
            self._done.set()

    def poll(self) -> int | None:
        return self.wait(0) if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._done.wait(_LINGER_S if timeout is None else min(timeout, _LINGER_S)):
            if timeout is not None and timeout <= _LINGER_S:
                raise TimeoutError("command still running")
            self._stream.close()  # bash has reported (the base waits only then); a child holds the stream
            self.returncode = self._stream.code or 0
        if self.returncode is None:
            if self._stream.code is None and not self.killed:
                raise BackendError(f"kubernetes: lost the exec stream: {self._stream.error}")
            self.returncode = -9 if self._stream.code is None else self._stream.code
        return self.returncode

    def terminate(self) -> None:
        self.killed = True
        self._killer(True)

    def kill(self) -> None:
        self.killed = True
        self._killer(False)

    @property
    def stderr(self) -> bytes:
        return self._stream.stderr


class PodTarget:
    """The ``Target``: a pod (or an agent-sandbox claim's pod) reached through the exec API."""

    def __init__(self, config: KubernetesConfig, task_id: str, on_recreate: Any) -> None:
        self.config, self.task_id, self._on_recreate = config, task_id, on_recreate
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
        self._streams: list[_Stream] = []  # the core's long-lived ones, for explain_exit

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
        version = str(claim["apiVersion"]).split("/")[1]
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

    # -- the Target protocol -------------------------------------------------------------
    def open_channel(self, argv: Sequence[str]) -> _Stream:
        """A long-lived exec with stdin: the core's session server and its kill stream run on it."""
        stream = self._open(argv)
        with self._lock:
            self._streams = [s for s in self._streams if not s.closed][-8:] + [stream]
        return stream

    def explain_exit(self, started: float) -> tuple[int, str] | None:
        """The server's exec ended mid-command: its exit status tells, unless the pod is gone."""
        ended = [s for s in self._streams if s.ended is not None and s.ended >= started and s.code is not None]
        last = max(ended, key=lambda s: s.ended or 0.0, default=None)
        if last is None or self._lost(last.pod):
            return None
        return last.code or 0, f"the session's shell in pod {last.pod} ended (exit {last.code})"

    def _open(self, argv: Sequence[str], retry: bool = True) -> _Stream:
        pod = self._pod()
        try:
            with self._exec_lock:
                ws = self._k8s.stream.stream(
                    self._exec_api.connect_get_namespaced_pod_exec, pod, self.namespace, command=list(argv),
                    stdin=True, stdout=True, stderr=True, tty=False, _preload_content=False, binary=True)
        except self._k8s.client.ApiException as exc:
            if self._lost(pod):  # the core calls recover(), then opens the stream once more
                raise TargetLostError(f"pod {pod} was gone; files written in it are lost") from exc
            if exc.status == 0 and retry:  # the connection failed before any answer (a TLS handshake): once more
                return self._open(argv, retry=False)
            raise self._error(exc, f"exec in pod {pod}") from exc
        return _Stream(ws, self.config.keepalive_s, pod)

    def start(self, request: RunRequest, stderr: int = 1) -> _Proc:
        """``bash -c request.script``, stderr merged into stdout (``stderr=2``: kept apart, in ``_Proc.stderr``)."""
        data, stdin, nonce = request.script.encode("utf-8", "surrogateescape"), request.stdin or b"", secrets.token_hex(8)
        argv = ["bash", "-c", _PRELUDE, "bash", str(len(data)), str(len(stdin)), nonce, str(stderr)]
        stream = self._open(argv + (["-l"] if request.login else []))
        return _Proc(stream, data + stdin, lambda graceful: self._kill(nonce, graceful))

    def _kill(self, nonce: str, graceful: bool) -> None:
        """Signal every process of the command in the pod, found by the nonce in its environment."""
        try:
            self.run_helper(KILL_TREE_FN + _FIND.format(nonce, "TERM" if graceful else "KILL"), timeout=30)
        except (HermesEnvError, TimeoutError):
            pass  # the pod is gone, and the command with it

    def run_helper(self, script: str, *, timeout: float) -> tuple[int, bytes]:
        return run_to_end(self.start(RunRequest(script=script, timeout=timeout)), timeout=timeout)

    def state_dir(self) -> str:
        return "/tmp"  # shared: the environment says so (state_dir_private), the core makes a private one in it

    def recover(self, why: str) -> bool:
        with self._lock:
            if self.pod_name is None or not self._lost(self.pod_name):
                return False  # not lost (a refused exec, a pod that cannot start): trying again would not help
            self._release()  # the next exec starts a new pod
        self._on_recreate()
        return True

    def release(self) -> None:
        with self._lock:
            self._release()


class KubernetesEnvironment(TargetEnvironment[KubernetesConfig]):
    """Runs commands in a pod (or an agent-sandbox claim) made for this environment."""

    name = "kubernetes"
    config_model = KubernetesConfig
    state_dir_private = False  # the target's /tmp is shared: the session server makes a private directory in it

    def __init__(self, config: KubernetesConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._sync: SyncEngine | None = None
        if self.config.sync:
            mappings = [s.mapping() for s in self.config.sync]
            self._sync = SyncEngine(CommandTransport(self._sync_run), mappings, interval=self.config.sync_interval_s)
        self.target  # noqa: B018 - loads the cluster configuration now; the pod comes with the first command

    def make_target(self, config: KubernetesConfig) -> PodTarget:
        return PodTarget(config, self.task_id, self._recreated)

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

    def _recreated(self) -> None:
        if self._sync is not None:
            self._sync.reset()  # the new pod gets every file again, before the command
            self._sync.push(force=True)

    # -- files ---------------------------------------------------------------------------------
    def _sync_run(self, script: str, stdin: Any) -> bytes:
        proc = self.pod.start(RunRequest(script=script, stdin=stdin), stderr=2)  # stdout is a tar stream
        code, out = run_to_end(proc, timeout=3600.0)
        if code != 0:
            raise CommandFailedError(script, code, proc.stderr)
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
