"""The ``example`` backend: bash on this machine, starting in a directory of its own.

Written against hermes-env's public ``Target`` interface only: the target
says how to start bash and where its private directory is; the session,
timeouts, cancel and output are the core's.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from pydantic import Field

from hermes_env_core import EnvironmentConfig, ProcessHandle, RunRequest, Target, TargetEnvironment
from hermes_env_core.backends.local import filter_environment, start_bash


class ExampleConfig(EnvironmentConfig):
    """Options of the example backend: the common ones plus ``root``."""

    root: str | None = Field(None, description="Directory commands start in (default: a new temporary one).")


class ExampleTarget(Target):
    """This machine, seen from one directory; a missing ``root`` is made here and removed by ``release``."""

    def __init__(self, root: str | None, env: dict[str, str]) -> None:
        self.own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="hermes-env-example-")
        self.env = env
        self.private = tempfile.mkdtemp(prefix="hermes-env-example-state-")  # 0700, unguessable

    def start(self, request: RunRequest) -> ProcessHandle:
        # start_bash: own session and cgroup, whole-tree kill, stdin fed, long scripts through a pipe.
        return start_bash(request, env=self.env, cwd=self.root)

    def state_dir(self) -> str:
        return self.private

    def recover(self, why: str) -> bool:
        return False  # this machine does not go away; a lost target here is a real failure

    def release(self) -> None:
        shutil.rmtree(self.private, ignore_errors=True)
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)


class ExampleEnvironment(TargetEnvironment[ExampleConfig]):
    """Runs commands with bash on this machine, starting in ``root``."""

    name = "example"
    config_model = ExampleConfig

    def make_target(self, config: ExampleConfig) -> ExampleTarget:
        env = filter_environment(os.environ)  # secrets stay out of commands
        env.update(config.env)
        return ExampleTarget(config.root, env)

    @property
    def root(self) -> str:
        target = self.target
        assert isinstance(target, ExampleTarget)
        return target.root

    @classmethod
    def check_requirements(cls) -> list[str]:
        """Problems that would stop this backend here (``hermes-env doctor`` prints them)."""
        if shutil.which("bash") is None:
            return ["bash is not on PATH: install bash (apt-get install bash)"]
        return []
