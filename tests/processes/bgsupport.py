"""Helpers for the background-process tests: fast registries and real local, docker and ssh environments."""

from __future__ import annotations

from pathlib import Path

from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.processes import PollSettings, ProcessRegistry

# Fast enough that tests do not wait on the defaults (10 s windows, 2 s polls).
FAST_POLL = PollSettings(min_s=0.02, max_s=0.25, factor=2.0)


def make_registry(tmp_path: Path | None = None, **options: object) -> ProcessRegistry:
    opts: dict[str, object] = {"poll": FAST_POLL, "keep_finished_s": 600.0}
    if tmp_path is not None:
        opts["checkpoint"] = tmp_path / "processes.json"
    opts.update(options)
    return ProcessRegistry(**opts)  # type: ignore[arg-type]


def docker_env(**options: object) -> BaseEnvironment:
    from tests.support.docker_engine import ensure_engine, ensure_test_image

    client = ensure_engine()
    image = ensure_test_image(client)
    from hermes_env_core.backends.docker import DockerEnvironment

    opts: dict[str, object] = {"image": image, "timeout": 60, "pids_limit": 128, "memory": "512m"}
    opts.update(options)
    return DockerEnvironment(**opts)


def ssh_env(server, tmp_path: Path, **options: object) -> BaseEnvironment:
    from hermes_env_core.backends.ssh import SSHEnvironment

    opts: dict[str, object] = {
        "host": server.host,
        "port": server.port,
        "user": server.user,
        "key_path": str(server.client_key_path),
        "use_agent": False,
        "look_for_keys": False,
        "known_hosts": str(tmp_path / "known_hosts"),
        "timeout": 60,
    }
    opts.update(options)
    return SSHEnvironment(**opts)
