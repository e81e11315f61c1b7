"""The ``example`` backend: the local backend, started in a directory of its own.

``root`` is where commands start; when not given, a fresh temporary directory
is made and removed again by ``close()``.
"""

from __future__ import annotations

import shutil
import tempfile

from pydantic import Field

from hermes_env_core.backends.local import LocalConfig, LocalEnvironment


class ExampleConfig(LocalConfig):
    """Options of the example backend: the local ones plus ``root``."""

    root: str | None = Field(None, description="Directory commands start in (default: a new temporary one).")


class ExampleEnvironment(LocalEnvironment):
    """Runs commands with bash on this machine, starting in ``root``."""

    name = "example"
    config_model = ExampleConfig

    def __init__(self, config: ExampleConfig | None = None, **options: object) -> None:
        if config is None:
            config = ExampleConfig(**options)  # type: ignore[arg-type]
        elif options:
            config = config.model_copy(update=options)
        self._own_root = config.root is None
        root = config.root or tempfile.mkdtemp(prefix="hermes-env-example-")
        update: dict[str, object] = {"root": root}
        if config.cwd is None:
            update["cwd"] = root
        super().__init__(config.model_copy(update=update))

    @property
    def root(self) -> str:
        return self.config.root  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def check_requirements(cls) -> list[str]:
        """Problems that would stop this backend here (``hermes-env doctor`` prints them)."""
        if shutil.which("bash") is None:
            return ["bash is not on PATH: install bash (apt-get install bash)"]
        return []

    def cleanup(self) -> None:
        super().cleanup()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
