"""Background processes on a real OpenSSH server on 127.0.0.1 (the sandbox path)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_env_core.environment.base import BaseEnvironment
from tests.processes.bgsupport import ssh_env
from tests.processes.suite import BackgroundSuite

pytestmark = pytest.mark.ssh


class TestSSH(BackgroundSuite):
    exit_latency_s = 0.5

    @pytest.fixture
    def env(self, sshd_server, tmp_path: Path) -> Iterator[BaseEnvironment]:
        self._server, self._tmp = sshd_server, tmp_path
        with ssh_env(sshd_server, tmp_path) as env:
            yield env

    def make_env(self, request: pytest.FixtureRequest, **options: object) -> BaseEnvironment:
        options.pop("reuse", None)
        server = request.getfixturevalue("sshd_server")
        env = ssh_env(server, request.getfixturevalue("tmp_path"), **options)
        request.addfinalizer(env.close)
        return env

    def owner_spec(self, request: pytest.FixtureRequest) -> dict[str, object]:
        server = request.getfixturevalue("sshd_server")
        tmp = request.getfixturevalue("tmp_path")
        return {
            "backend": "ssh",
            "options": {
                "host": server.host,
                "port": server.port,
                "user": server.user,
                "key_path": str(server.client_key_path),
                "use_agent": False,
                "look_for_keys": False,
                "known_hosts": str(tmp / "known_hosts"),
            },
        }
