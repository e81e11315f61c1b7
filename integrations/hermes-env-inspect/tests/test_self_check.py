"""inspect_ai's own sandbox checks (every ``test_*`` of ``inspect_ai.util._sandbox.self_check``) on ``hermes``.

Run on the local backend and on docker as root and as a non-root user. A
check this setup cannot satisfy is a strict xfail with its reason (the
README lists them): it must fail, so a change that makes it pass shows.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import inspect_ai.util._sandbox.self_check as _self_check
from hermes_env_inspect import HermesSandboxConfig, HermesSandboxEnvironment
from inspect_ai.util._sandbox.self_check import *  # noqa: F401,F403

pytestmark = pytest.mark.anyio

ROOT_READS = "root reads a file whatever its mode bits (inspect marks these not applicable when run as root)"
ROOT_WRITES = "root can overwrite a read-only file (inspect marks this not applicable when run as root)"
NO_USER_TOOLS = "the test image has neither adduser nor runuser (no user can be added or switched to)"
NEEDS_ROOT = "adding a user and switching to it needs root"

CHECKS = sorted(_self_check.__all__)


def test_every_inspect_check_is_collected() -> None:
    # the star import above is what pulls them in; a check inspect adds is run too
    names = {n for n in globals() if n.startswith("test_") and n != "test_every_inspect_check_is_collected"}
    assert set(CHECKS) <= names
    assert len(CHECKS) >= 40


@dataclass
class Setup:
    id: str
    backend: str
    options: dict[str, Any]
    root: bool
    xfails: dict[str, str] = field(default_factory=dict)


def _root_xfails() -> dict[str, str]:
    return {
        "test_read_file_not_allowed": ROOT_READS,
        "test_write_text_file_without_permissions": ROOT_WRITES,
        "test_write_binary_file_without_permissions": ROOT_WRITES,
    }


def _setups() -> list[Any]:
    local_root = os.geteuid() == 0
    local_xfails = _root_xfails() if local_root else {"test_exec_as_user": NEEDS_ROOT}
    if local_root and shutil.which("adduser") is None:
        local_xfails["test_exec_as_user"] = "this machine has no adduser (the check adds its user with it)"
    local = Setup("local", "local", {}, local_root, local_xfails)
    docker_root = Setup("docker-root", "docker", {}, True, {**_root_xfails(), "test_exec_as_user": NO_USER_TOOLS})
    docker_agent = Setup("docker-agent", "docker", {"user": "agent"}, False, {"test_exec_as_user": NO_USER_TOOLS})
    return [pytest.param(s, id=s.id) for s in (local, docker_root, docker_agent)]


@pytest.fixture(scope="module", params=_setups())
async def _sandbox(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[tuple[Setup, Any]]:
    setup: Setup = request.param
    options = dict(setup.options)
    if setup.backend == "docker":
        options["image"] = request.getfixturevalue("test_image")
    config = HermesSandboxConfig(backend=setup.backend, options=options)
    task = f"self-check-{setup.id}"
    await HermesSandboxEnvironment.task_init(task, config)
    envs = await HermesSandboxEnvironment.sample_init(task, config, {})
    try:
        yield setup, envs["default"]
    finally:
        await HermesSandboxEnvironment.sample_cleanup(task, config, envs, False)
        await HermesSandboxEnvironment.task_cleanup(task, config, True)


@pytest.fixture
def sandbox_env(request: pytest.FixtureRequest, _sandbox: tuple[Setup, Any]) -> Any:
    setup, env = _sandbox
    reason = setup.xfails.get(request.node.originalname)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    return env
