"""Managed mode: the seed system's Modal gateway holds the Modal credentials and
runs each command in a sandbox it owns (contract in ``gateway.py``).

Every command is the core's wrapped bash script sent as one exec, so the
session semantics (state capture and restore, cwd, exit codes) are the same as
on every other backend; timeout and cancel kill the command's process tree
with a second exec and cancel the exec at the gateway.
"""

from __future__ import annotations

import base64
import logging
import secrets
import shlex
import threading
import time
import uuid
from typing import Any

from hermes_env_core.environment.handles import ProcessHandle, ThreadedProcessHandle, Writer
from hermes_env_core.environment.session import WrappedCommand, kill_tree_script
from hermes_env_core.errors import (
    BackendError,
    ConfigError,
    EnvironmentUnavailable,
    HermesEnvError,
    UnsupportedOperation,
)

from ._image import CHECK_SCRIPT, parse_check, requirement_message
from ._kill import exec_head, find_pids_script, parse_pids
from .backend import ModalEnvironment
from .config import ModalConfig, explicit_gateway_token, gateway_auth_file, gateway_url, memory_mib
from .gateway import FINAL_STATUSES, GatewayClient, SandboxGoneError, TokenSource

__all__ = ["ManagedModalEnvironment"]

log = logging.getLogger(__name__)

# hermes-agent polls every 0.25 s (modal_utils: _poll_interval_seconds); we
# start faster so that a quick command returns quickly, then settle there.
_POLL_FIRST_S = 0.02
_POLL_MAX_S = 0.25
# Defaults hermes-agent's client sends when it is told nothing
# (managed_modal._create_sandbox: cpu 1, memoryMiB 5120, idle at least 300 s; cwd /root).
_DEFAULT_CPU = 1
_DEFAULT_MEMORY_MIB = 5120
_DEFAULT_IDLE_S = 300
_DEFAULT_CWD = "/root"
_DEFAULT_IMAGE = "debian:bookworm-slim"
_HELPER_S = 120.0  # bound on a helper exec (kill, image check)
# Longer scripts travel as the exec's stdinData: the gateway runs commands in
# Modal, whose SDK refuses exec arguments over 2**16 characters.
_ARG_LIMIT = 60_000


class GatewayProcess(ThreadedProcessHandle):
    """One gateway exec seen as a process: polled until its status is final."""

    def __init__(self, env: ManagedModalEnvironment, sandbox_id: str, exec_id: str, first: dict[str, Any], token: str):
        self.token = token
        self.exec_id = exec_id
        self.sandbox_id = sandbox_id
        self.pids: tuple[int, ...] = ()
        self._env = env
        self._first = first
        self._stop = threading.Event()
        super().__init__(self._follow, on_kill=self._cancel, name=f"hermes-env-modal-gw-{exec_id[:8]}")

    def _follow(self, write: Writer) -> int:
        api = self._env.api
        state, written, interval = self._first, "", _POLL_FIRST_S
        while True:
            # A poll of a running exec may carry the output so far (not public,
            # see the README); the final answer carries all of it.
            out = state.get("output")
            if isinstance(out, str) and len(out) > len(written):
                if out.startswith(written):
                    write(out[len(written) :].encode("utf-8", "surrogateescape"))
                else:
                    log.warning("modal gateway: exec %s output changed under us; keeping what was read", self.exec_id)
                written = out
            status = state.get("status")
            if status in FINAL_STATUSES:
                return self._code(status, state.get("returncode"))
            self._stop.wait(interval)
            interval = min(_POLL_MAX_S, interval * 2)
            state = api.poll_exec(self.sandbox_id, self.exec_id)

    def _code(self, status: str, code: object) -> int:
        if status == "cancelled" and not self.killed:
            raise BackendError(f"modal gateway: exec {self.exec_id} was cancelled by the gateway")
        if status == "timeout" and not self.killed:
            raise BackendError(
                f"modal gateway: exec {self.exec_id} hit the gateway's own time limit before ours; its result is unknown"
            )
        if isinstance(code, bool) or not isinstance(code, int):
            if self.killed:
                return 137  # killed on our request; the base class reports 124/130
            raise BackendError(f"modal gateway: exec {self.exec_id} ended ({status}) without a returncode")
        return code

    def _cancel(self) -> None:
        try:
            self._env.api.cancel_exec(self.sandbox_id, self.exec_id)
        except HermesEnvError as exc:
            log.warning("modal gateway: cancel of %s failed: %s", self.exec_id, exc)


class ManagedModalEnvironment(ModalEnvironment):
    """One gateway sandbox per environment."""

    mode = "managed"
    config_model = ModalConfig
    stdin_mode = "payload"  # the gateway's exec takes stdin as stdinData

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
                "modal: the managed gateway offers no file transfer; remove the sync option or use mode = 'direct'"
            )
        token = explicit_gateway_token(cfg)
        tokens = TokenSource(static=token) if token is not None else TokenSource(auth_file=gateway_auth_file(cfg))
        self.api = GatewayClient(
            gateway_url(cfg),
            tokens,
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            retries=cfg.gateway_retries,
        )
        self._cwd0 = cfg.workdir or _DEFAULT_CWD
        self._state = "/tmp"
        self._sb_lock = threading.Lock()
        self._sandbox_id: str | None = None
        try:
            self._sandbox_id = self._create()
            self._check_image()
        except BaseException:
            self._release()
            raise

    @property
    def sandbox_id(self) -> str | None:
        return self._sandbox_id

    # -- sandbox life ----------------------------------------------------------------
    def _create_body(self) -> dict[str, Any]:
        cfg = self._cfg
        idle = cfg.idle_timeout if cfg.idle_timeout is not None else _DEFAULT_IDLE_S
        return {
            "image": cfg.image or _DEFAULT_IMAGE,
            "cwd": self._cwd0,
            "cpu": cfg.cpu if cfg.cpu is not None else _DEFAULT_CPU,
            "memoryMiB": memory_mib(cfg.memory) if cfg.memory is not None else _DEFAULT_MEMORY_MIB,
            "timeoutMs": cfg.sandbox_timeout * 1000,
            "idleTimeoutMs": idle * 1000,
            "persistentFilesystem": cfg.persistent,
            "logicalKey": self.task_id,
        }

    def _create(self) -> str:
        # One key per sandbox we mean to create: a retry after a lost answer gets the same sandbox.
        return self.api.create_sandbox(self._create_body(), key=str(uuid.uuid4()))

    def _check_image(self) -> None:
        code, out = self._helper(CHECK_SCRIPT, shell="sh", timeout=self._cfg.image_check_timeout)
        facts = parse_check(out)
        if facts is None:
            raise EnvironmentUnavailable(
                f"modal gateway: the image check did not run in sandbox {self._sandbox_id} "
                f"(exit {code}): {out[-300:]!r}; the image needs sh, bash >= 4.4 and /proc"
            )
        problems = facts.problems(needs_tar=False)
        if problems:
            raise ConfigError(requirement_message(self._cfg.image or _DEFAULT_IMAGE, problems))
        self._state = self._cfg.state_dir or ("/dev/shm" if facts.shm else "/tmp")

    def _recreate(self, dead: str) -> None:
        with self._sb_lock:
            if self._sandbox_id != dead:
                return
            try:
                self._sandbox_id = self._create()
            except HermesEnvError as exc:
                raise EnvironmentUnavailable(
                    f"modal gateway: sandbox {dead} has ended and a new one could not be created: {exc}"
                ) from exc
        kept = (
            "the gateway restores the files it snapshotted for this task"
            if self._cfg.persistent
            else "files written there are gone"
        )
        self._note(
            f"modal: sandbox {dead} had ended (timeout, idle or terminated); continuing in a new sandbox "
            f"{self._sandbox_id}: {kept}, the shell state is kept"
        )

    def _state_dir(self) -> str:
        return self._state

    # -- commands --------------------------------------------------------------------
    def _start(
        self, command: str, timeout: float | None, stdin: str | None = None
    ) -> tuple[str, str, dict[str, Any]]:
        """Start ``command``; (sandbox id, exec id, first answer). Replaces an ended sandbox once."""
        if timeout:
            # A backstop only: the base class stops the command first.
            limit_s = timeout + self.config.kill_grace_s + 30.0
        else:
            limit_s = float(self._cfg.sandbox_timeout)
        for attempt in (1, 2):
            sandbox_id = self._sandbox_id
            if sandbox_id is None:
                raise EnvironmentUnavailable("modal gateway: the environment has no sandbox (closed)")
            exec_id = str(uuid.uuid4())
            body: dict[str, Any] = {
                "execId": exec_id,
                "command": command,
                "cwd": self._cwd0,
                "timeoutMs": int(limit_s * 1000),
            }
            if stdin is not None:
                body["stdinData"] = stdin
            try:
                first = self.api.start_exec(sandbox_id, body)
            except SandboxGoneError:
                if attempt == 2 or not self._cfg.recreate:
                    raise
                self._recreate(sandbox_id)
                continue
            answered = first.get("execId")
            if answered is not None and answered != exec_id:
                raise BackendError(f"modal gateway: started exec {exec_id} but the answer names {answered!r}")
            return sandbox_id, exec_id, first
        raise AssertionError("unreachable")

    def _run_bash(
        self, script: str, *, login: bool, timeout: float | None, stdin_data: bytes | None
    ) -> ProcessHandle:
        token = secrets.token_hex(8)
        bash = "bash -l -c " if login else "bash -c "
        feed: bytes | None = None
        if stdin_data is not None:
            # stdin (the session's private script, or the command's input) goes as
            # the exec's stdinData -- never on the command line.
            if len(script) > _ARG_LIMIT:
                raise UnsupportedOperation(
                    "modal gateway: a script over 60 kB together with stdin cannot be sent in one exec"
                )
            inner = exec_head(token) + "exec 2>&1; " + script
            feed = stdin_data
        elif len(script) <= _ARG_LIMIT:
            inner = exec_head(token) + "exec </dev/null 2>&1; " + script
        else:
            # bash's source reads the whole script (fed as stdin) before running any of it.
            inner = exec_head(token) + "exec 3<&0 </dev/null 2>&1; builtin source /dev/fd/3"
            feed = b"exec 3<&-; " + script.encode("utf-8", "surrogateescape")
        command = "exec " + bash + shlex.quote(inner)
        stdin: str | None = None
        if feed is not None:
            try:
                stdin = feed.decode("utf-8")
            except UnicodeDecodeError:
                # stdinData is JSON text: bytes that are not UTF-8 travel as base64.
                stdin = base64.b64encode(feed).decode("ascii")
                command = "base64 -d | " + command
        sandbox_id, exec_id, first = self._start(command, timeout, stdin)
        return GatewayProcess(self, sandbox_id, exec_id, first, token)

    def _helper(self, script: str, *, shell: str = "bash", timeout: float = _HELPER_S) -> tuple[int, str]:
        """Run ``script`` outside the session and wait for it: (returncode, output)."""
        sandbox_id, exec_id, state = self._start(f"exec {shell} -c {shlex.quote(script)}", timeout)
        deadline = time.monotonic() + timeout
        interval = _POLL_FIRST_S
        while state.get("status") not in FINAL_STATUSES:
            if time.monotonic() > deadline:
                self.api.cancel_exec(sandbox_id, exec_id)
                raise EnvironmentUnavailable(f"modal gateway: a helper command got no answer within {timeout:g}s")
            time.sleep(interval)
            interval = min(_POLL_MAX_S, interval * 2)
            state = self.api.poll_exec(sandbox_id, exec_id)
        code = state.get("returncode")
        out = state.get("output")
        if isinstance(code, bool) or not isinstance(code, int):
            raise BackendError(f"modal gateway: helper exec {exec_id} ended ({state.get('status')}) without a code")
        return code, out if isinstance(out, str) else ""

    def _kill_tree(self, handle: ProcessHandle, wrapped: WrappedCommand, *, graceful: bool) -> None:
        if not isinstance(handle, GatewayProcess):
            handle.kill()
            return
        sig = "TERM" if graceful else "KILL"
        try:
            if not handle.pids:
                handle.pids = parse_pids(self._helper(find_pids_script(handle.token, wrapped.pidfile))[1])
            if handle.pids:
                self._helper("".join(kill_tree_script(p, sig) for p in handle.pids))
        except HermesEnvError as exc:
            log.warning("modal gateway: killing exec %s failed: %s", handle.exec_id, exc)
        if not graceful:
            handle.kill()  # and cancel the exec at the gateway

    # -- teardown --------------------------------------------------------------------
    def cleanup(self) -> None:
        self._release()

    def _release(self) -> None:
        sandbox_id, self._sandbox_id = self._sandbox_id, None
        try:
            if sandbox_id is not None:
                try:
                    self.api.terminate(sandbox_id, snapshot=self._cfg.persistent)
                except SandboxGoneError:
                    pass
                except HermesEnvError as exc:
                    if self._cfg.persistent:
                        raise  # the snapshot this task relies on was not taken
                    # The gateway ends it at its timeoutMs/idleTimeoutMs anyway.
                    log.warning("modal gateway: terminating %s failed: %s", sandbox_id, exc)
        finally:
            self.api.close()
