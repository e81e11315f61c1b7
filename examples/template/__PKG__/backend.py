"""The __NAME__ backend: TODO say where commands run.

As generated it runs bash on this machine, so it passes the conformance suite
from the first minute; replace each TODO with your SDK's calls, keeping the
contract each ``Target`` method's docstring states.
"""

from __future__ import annotations

import shutil
import tempfile

from pydantic import Field

from hermes_env_core import EnvironmentConfig, ProcessHandle, RunRequest, Target, TargetEnvironment
from hermes_env_core.backends.local import start_bash


class __CLASS__Config(EnvironmentConfig):
    """Options of the __NAME__ backend (unknown keys are rejected, naming the key)."""

    # TODO: your options, with the same names and units as other backends where they exist.
    bash: str = Field("bash", description="The bash executable in the target.")


class __CLASS__Target(Target):
    """How to reach the place where commands run (TODO: a client of your SDK)."""

    def __init__(self, config: __CLASS__Config) -> None:
        self.config = config
        # TODO: create or attach to the sandbox/container/host here.
        self.private = tempfile.mkdtemp(prefix="__PKG__-")  # TODO: make it in the target (0700)

    def start(self, request: RunRequest) -> ProcessHandle:
        # TODO: start `bash -c request.script` there; kill() must end the whole tree.
        # Raise TargetLostError if the target is gone.
        return start_bash(request, bash=self.config.bash)

    def state_dir(self) -> str:
        return self.private

    def recover(self, why: str) -> bool:
        return False  # TODO: recreate the target and return True, if it can be

    def release(self) -> None:
        shutil.rmtree(self.private, ignore_errors=True)  # TODO: delete the sandbox, close the client


class __CLASS__Environment(TargetEnvironment[__CLASS__Config]):
    """Runs commands in TODO."""

    name = "__NAME__"
    config_model = __CLASS__Config

    def make_target(self, config: __CLASS__Config) -> __CLASS__Target:
        return __CLASS__Target(config)

    @classmethod
    def check_requirements(cls) -> list[str]:
        """Problems that stop this backend here, for `hermes-env doctor` (a missing SDK, binary, credential)."""
        return [] if shutil.which("bash") else ["bash is not on PATH"]
