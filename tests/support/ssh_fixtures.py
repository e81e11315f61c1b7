"""pytest plugin: a real OpenSSH server on 127.0.0.1.

Enable it from a conftest::

    pytest_plugins = ["tests.support.ssh_fixtures"]

Fixtures:

``sshd_server`` (session)
    A started ``tests.support.sshd.SshServer`` shared by the whole run. Do
    not call its destructive levers (``regenerate_host_key``, ``restart``,
    ``stop``) from a test that shares it; ``kill_user_sessions`` is fine if
    the test owns every connection it kills.

``private_sshd_server`` (function)
    A server of the test's own (~0.2 s to start), for tests that change the
    host key, restart or stop the server.

Both first run ``scripts/ensure-sshd.sh`` (once per session). In CI
(``CI=true``) a server that cannot be provided fails the test; elsewhere it
is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.sshd import SshServer, SshdUnavailable, in_ci, sshd_available

REPO_ROOT = Path(__file__).resolve().parents[2]
ENSURE_SCRIPT = REPO_ROOT / "scripts" / "ensure-sshd.sh"

_ensured: str | None = None  # "" once ensured, else the failure text


def _unavailable(reason: str) -> None:
    if in_ci():
        pytest.fail(f"OpenSSH server required in CI: {reason}", pytrace=False)
    pytest.skip(f"OpenSSH server not available: {reason}")


def _ensure_sshd() -> None:
    global _ensured
    if _ensured is None:
        if os.geteuid() != 0 and not sshd_available():
            _ensured = "not root, and /usr/sbin/sshd is not installed"
        else:
            r = subprocess.run(
                ["bash", str(ENSURE_SCRIPT)],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=900,
            )
            if r.returncode == 0:
                _ensured = ""
            else:
                tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
                _ensured = f"{ENSURE_SCRIPT.name} failed ({r.returncode}):\n{tail}"
    if _ensured:
        _unavailable(_ensured)


def _start() -> SshServer:
    _ensure_sshd()
    server = SshServer()
    try:
        server.start()
    except SshdUnavailable as e:
        _unavailable(str(e))
    return server


@pytest.fixture(scope="session")
def sshd_server() -> Iterator[SshServer]:
    server = _start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def private_sshd_server() -> Iterator[SshServer]:
    server = _start()
    try:
        yield server
    finally:
        server.close()
