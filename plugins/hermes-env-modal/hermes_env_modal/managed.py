"""Managed mode: a gateway that holds the Modal credentials runs the commands.

The gateway keeps the shell session (cwd, variables) server-side, so this
class has its own ``execute()``: start the command, long-poll its output into
the core's bounded capture, and map the outcome onto the same ``ExecResult``
and exit codes as every other backend (124 timeout, 126 cwd, 130 cancelled).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hermes_env_core.environment.handles import ProcessHandle
from hermes_env_core.environment.output import OutputCapture
from hermes_env_core.environment.result import EXIT_CANCELLED, EXIT_TIMEOUT, ExecResult
from hermes_env_core.errors import (
    ConfigError,
    EnvironmentClosedError,
    EnvironmentUnavailable,
    UnsupportedOperation,
)

from .backend import ModalEnvironment
from .config import ModalConfig, default_snapshot_store, memory_mib
from .gateway import GatewayClient, SandboxEndedError
from .snapshots import SnapshotStore

__all__ = ["ManagedModalEnvironment"]

log = logging.getLogger(__name__)

_CANCEL_POLL_S = 0.25  # longest a poll holds while a cancel may come
_GIVE_UP_S = 10.0  # after asking the gateway to stop a command, how long to wait for it


class _GatewaySession:
    """What the base class's ``session`` offers callers, for a session kept server-side."""

    def __init__(self) -> None:
        self.cwd: str | None = None
        self.state = None


class ManagedModalEnvironment(ModalEnvironment):
    """One gateway sandbox per environment."""

    mode = "managed"
    config_model = ModalConfig

    def __init__(self, config: ModalConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        cfg: ModalConfig = self.config  # type: ignore[assignment]
        self._cfg = cfg
        if cfg.credential_files or any(m.upload_only for m in cfg.sync):
            raise ConfigError(
                "modal: managed mode does not pass credential files into sandboxes: the gateway holds the "
                "Modal credentials and keeps host secrets out of them. Remove credential_files (and "
                "upload_only sync mappings), or use mode = 'direct' with your own Modal token."
            )
        if cfg.sync:
            raise ConfigError(
                "modal: file sync is not offered by the managed gateway (API v1); remove the sync option "
                "or use mode = 'direct'"
            )
        assert cfg.gateway_url is not None and cfg.gateway_token is not None  # resolve_mode checked
        self._remote = _GatewaySession()
        self._store = SnapshotStore(cfg.snapshot_store or default_snapshot_store()) if cfg.persistent else None
        self._store_key = f"managed:{cfg.gateway_url}:{self.task_id}"
        self._sb_lock = threading.Lock()
        self.restored_from: str | None = None
        self._api = GatewayClient(
            cfg.gateway_url,
            cfg.gateway_token.get_secret_value(),
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            retries=cfg.gateway_retries,
        )
        try:
            self._sandbox_id: str | None = self._create()
        except BaseException:
            self._api.close()
            raise

    @property
    def sandbox_id(self) -> str | None:
        return self._sandbox_id

    @property
    def session(self) -> _GatewaySession:  # type: ignore[override]
        return self._remote

    # -- sandbox lifecycle ---------------------------------------------------------
    def _create(self) -> str:
        cfg = self._cfg
        record = self._store.get(self._store_key) if self._store is not None else None
        body = {
            "task_id": self.task_id,
            "app_name": cfg.app_name,
            "image": cfg.image,
            "image_id": cfg.image_id,
            "restore_image_id": record.image_id if record else None,
            "workdir": cfg.workdir,
            "cwd": cfg.cwd,
            "cpu": cfg.cpu,
            "memory": memory_mib(cfg.memory) if cfg.memory is not None else None,
            "region": cfg.region,
            "block_network": cfg.block_network,
            "timeout_s": cfg.sandbox_timeout,
            "idle_timeout_s": cfg.idle_timeout,
            "env": dict(cfg.env),
            "session_exclude_prefixes": list(cfg.session_exclude_prefixes),
        }
        resp = self._api.create_sandbox(body)
        sandbox_id = resp.get("sandbox_id")
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise EnvironmentUnavailable(f"modal gateway: create answered without a sandbox_id: {resp!r:.200}")
        self.restored_from = resp.get("restored_from")
        if record is not None and resp.get("restore_error"):
            self._note(
                f"modal: could not restore snapshot {record.image_id} of task {self.task_id!r} "
                f"({resp['restore_error']}); started from the base image instead"
            )
        if resp.get("cwd"):
            self._remote.cwd = resp["cwd"]
        return sandbox_id

    def _recreate(self, dead: str) -> None:
        with self._sb_lock:
            if self._sandbox_id != dead:
                return
            self._sandbox_id = self._create()
            self._note(
                f"modal: sandbox {dead} had ended (timeout or terminated); continuing in a new sandbox "
                f"{self._sandbox_id}: its files and shell state start afresh"
            )

    # -- the contract --------------------------------------------------------------
    def execute(
        self,
        command: str,
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        cancel: threading.Event | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> ExecResult:
        """Run ``command`` in the gateway's session, as if typed into one long-lived bash."""
        if self._closed:
            raise EnvironmentClosedError(f"{self.name} environment {self.task_id!r} is closed")
        started = time.monotonic()
        eff_timeout = self.config.timeout if timeout is None else timeout
        data = stdin.encode("utf-8") if isinstance(stdin, str) else stdin
        capture = OutputCapture(self.config.max_output_bytes, spill_dir=self.config.spill_dir, on_output=on_output)
        wait_s = _CANCEL_POLL_S if cancel is not None else self._api.poll_wait_s
        body = {
            "command": command,
            "cwd": cwd,
            "timeout_s": eff_timeout,
            "kill_grace_s": self.config.kill_grace_s,
            "stdin_b64": base64.b64encode(data).decode("ascii") if data is not None else None,
            "wait_s": min(wait_s, eff_timeout) if eff_timeout else wait_s,
        }
        sandbox_id = self._sandbox_id
        assert sandbox_id is not None
        try:
            state = self._api.start_exec(sandbox_id, body)
        except SandboxEndedError:
            if not self._cfg.recreate:
                raise
            self._recreate(sandbox_id)
            sandbox_id = self._sandbox_id
            assert sandbox_id is not None
            state = self._api.start_exec(sandbox_id, body)
        exec_id = state.get("exec_id")
        if not isinstance(exec_id, str):
            raise EnvironmentUnavailable(f"modal gateway: start answered without an exec_id: {state!r:.200}")
        # The gateway enforces the timeout; ours is the fallback when it does not.
        deadline = started + eff_timeout + self.config.kill_grace_s + 5.0 if eff_timeout else None
        reason: str | None = None
        stop_asked: float | None = None
        offset = 0
        while True:
            offset = self._take_output(state, offset, capture)
            if state.get("done"):
                break
            now = time.monotonic()
            if reason is None:
                if cancel is not None and cancel.is_set():
                    reason = "cancel"
                elif deadline is not None and now >= deadline:
                    reason = "timeout"
                if reason is not None:
                    self._api.cancel_exec(sandbox_id, exec_id)
                    stop_asked = now
            elif stop_asked is not None and now - stop_asked > _GIVE_UP_S:
                log.warning("modal gateway: exec %s still running %gs after cancel", exec_id, _GIVE_UP_S)
                break
            wait = _CANCEL_POLL_S if (cancel is not None or reason is not None) else self._api.poll_wait_s
            if deadline is not None and reason is None:
                wait = max(0.0, min(wait, deadline - now))
            state = self._api.poll_exec(sandbox_id, exec_id, offset=offset, wait_s=wait)
        cap = capture.finish()
        notes = self._take_notes()
        notes.extend(str(n) for n in state.get("notes") or ())
        timed_out = bool(state.get("timed_out")) or reason == "timeout"
        interrupted = bool(state.get("cancelled")) and not timed_out or reason == "cancel"
        if timed_out:
            exit_code = EXIT_TIMEOUT
            if not any("timed out" in n for n in notes):
                notes.append(f"command timed out after {eff_timeout:g}s")
        elif interrupted:
            exit_code = EXIT_CANCELLED
        elif state.get("done") and isinstance(state.get("exit_code"), int):
            exit_code = state["exit_code"]
        else:
            raise EnvironmentUnavailable(f"modal gateway: command {exec_id} ended without an exit code")
        new_cwd = state.get("cwd")
        if isinstance(new_cwd, str) and new_cwd and cwd is None:
            self._remote.cwd = new_cwd
        return ExecResult(
            output=cap.text,
            exit_code=exit_code,
            timed_out=timed_out,
            interrupted=interrupted and not timed_out,
            truncated=cap.truncated,
            cwd=new_cwd if isinstance(new_cwd, str) and new_cwd else self._remote.cwd,
            duration_s=time.monotonic() - started,
            output_path=cap.spill_path,
            dropped_bytes=cap.dropped_bytes,
            notes=tuple(notes),
        )

    @staticmethod
    def _take_output(state: dict[str, Any], offset: int, capture: OutputCapture) -> int:
        chunk = state.get("output_b64") or ""
        start = int(state.get("offset", offset))
        data = base64.b64decode(chunk) if chunk else b""
        if start < offset:  # a replayed answer: skip what we already have
            data = data[offset - start :]
        capture.feed(data)
        return max(offset, int(state.get("next_offset", start + len(data))))

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        raise UnsupportedOperation("modal managed mode: commands run through the gateway's execute(), not bash -c")

    def cleanup(self) -> None:
        sandbox_id, self._sandbox_id = self._sandbox_id, None
        try:
            if sandbox_id is None:
                return
            try:
                resp = self._api.terminate(sandbox_id, snapshot=self._store is not None)
            except SandboxEndedError:
                return
            image_id = resp.get("image_id")
            if self._store is not None:
                if isinstance(image_id, str) and image_id:
                    self._store.put(self._store_key, image_id, sandbox_id=sandbox_id, base_image=self._cfg.image)
                else:
                    raise EnvironmentUnavailable(
                        f"modal gateway: snapshot of sandbox {sandbox_id} failed: "
                        f"{resp.get('snapshot_error') or 'no image id returned'}"
                    )
        finally:
            self._api.close()
