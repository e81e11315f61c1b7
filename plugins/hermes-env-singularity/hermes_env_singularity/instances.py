"""Naming, listing and stopping our instances, and sweeping those whose owner died.

An instance is named ``hermes-env-<pid>-<start>-<task>-<random>``: the owner's
pid and its start time (clock ticks since boot, base 36), so a reused pid is
never mistaken for the owner.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
from collections.abc import Mapping

from hermes_env_core.errors import BackendError

from .runtime import Runtime, client_env, find_runtime, last_error

__all__ = ["INSTANCE_PREFIX", "instance_name", "list_instances", "owner_of", "stop_instance", "sweep_orphans"]

log = logging.getLogger(__name__)

INSTANCE_PREFIX = "hermes-env-"
_NAME_RE = re.compile(r"^hermes-env-(\d+)-([0-9a-z]+)-")
_TASK_RE = re.compile(r"[^A-Za-z0-9_.-]+")
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_GONE = ("no instance found", "no such instance")


def _base36(n: int) -> str:
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = _DIGITS[r] + out
        if n == 0:
            return out


def process_start(pid: int) -> str | None:
    """When ``pid`` started (base 36 clock ticks since boot), or None if it is not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    # fields[0] is the state (field 3); starttime is field 22.
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return _base36(int(fields[19]))


_OWN_START = process_start(os.getpid()) or "0"


def instance_name(task_id: str) -> str:
    """A fresh name for an instance owned by this process."""
    pid = os.getpid()
    start = process_start(pid) or _OWN_START
    task = _TASK_RE.sub("_", task_id)[:24].strip("_.-") or "env"
    return f"{INSTANCE_PREFIX}{pid}-{start}-{task}-{secrets.token_hex(3)}"


def owner_of(name: str) -> tuple[int, str] | None:
    """(pid, start) of the process that started instance ``name``, if it is ours."""
    m = _NAME_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def owner_alive(name: str) -> bool:
    owner = owner_of(name)
    if owner is None:
        return True  # not ours: never touched
    pid, start = owner
    return process_start(pid) == start


def list_instances(runtime: Runtime, env: Mapping[str, str] | None = None) -> list[dict[str, object]]:
    """``apptainer instance list --json``: every instance of this user."""
    proc = runtime.run(["instance", "list", "--json"], env=env or client_env(), timeout=60)
    if proc.returncode != 0:
        raise BackendError(f"singularity: 'instance list' failed (exit {proc.returncode}): {last_error(proc.stderr)}")
    try:
        data = json.loads(proc.stdout or "{}")
    except json.JSONDecodeError as exc:
        raise BackendError(f"singularity: 'instance list --json' printed no JSON: {proc.stdout[:200]!r}") from exc
    return list(data.get("instances") or [])


def stop_instance(runtime: Runtime, name: str, *, env: Mapping[str, str] | None = None, grace: int = 0) -> bool:
    """Stop instance ``name`` (SIGKILL after ``grace`` seconds); False if it was not running."""
    proc = runtime.run(["instance", "stop", "-t", str(int(grace)), name], env=env or client_env(), timeout=grace + 60)
    if proc.returncode == 0:
        return True
    if any(g in proc.stderr.lower() for g in _GONE):
        return False
    raise BackendError(f"singularity: 'instance stop {name}' failed (exit {proc.returncode}): {last_error(proc.stderr)}")


def sweep_orphans(runtime: Runtime | None = None, *, env: Mapping[str, str] | None = None) -> list[str]:
    """Stop the instances hermes-env started from processes that are gone; returns their names.

    Instances not named by hermes-env, and those of live processes, are left alone.
    """
    runtime = runtime or find_runtime()
    env = env or client_env()
    stopped: list[str] = []
    for item in list_instances(runtime, env):
        name = str(item.get("instance", ""))
        if owner_of(name) is None or owner_alive(name):
            continue
        try:
            if stop_instance(runtime, name, env=env):
                stopped.append(name)
                log.info("singularity: stopped orphaned instance %s", name)
        except BackendError as exc:
            log.warning("%s", exc)
    return stopped


_swept: set[str] = set()
_swept_lock = threading.Lock()


def sweep_in_background(runtime: Runtime, env: Mapping[str, str]) -> threading.Thread | None:
    """Sweep once per process and runtime, without making the caller wait."""
    key = f"{runtime.path}\0{runtime.config_file}\0{env.get('HOME', '')}"
    with _swept_lock:
        if key in _swept:
            return None
        _swept.add(key)

    def run() -> None:
        try:
            sweep_orphans(runtime, env=env)
        except Exception as exc:  # noqa: BLE001 - a sweep never breaks an environment
            log.warning("singularity: orphan sweep failed: %s", exc)

    thread = threading.Thread(target=run, name="hermes-env-singularity-sweep", daemon=True)
    thread.start()
    return thread
