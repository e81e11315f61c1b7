"""``ModalEnvironment``: the class the ``modal`` backend name resolves to.

Creating one picks the mode from its config (``resolve_mode``) and builds the
class for it: ``DirectModalEnvironment`` (modal SDK) or
``ManagedModalEnvironment`` (HTTP gateway). Only the chosen one's client is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.environment.channel import ChannelStream
from hermes_env_core.errors import ConfigError

from .config import ModalConfig, resolve_mode

__all__ = ["ModalEnvironment"]


class ModalEnvironment(BaseEnvironment):
    """bash in a Modal sandbox; ``ModalEnvironment(mode=...)`` returns the mode's subclass."""

    name = "modal"
    config_model = ModalConfig
    stdin_mode = "heredoc"
    records_pid = True
    #: "direct" or "managed", set by the subclass
    mode: ClassVar[str] = "auto"

    def __new__(cls, config: ModalConfig | None = None, **options: Any) -> ModalEnvironment:  # noqa: PYI034
        target = _class_for(_merged(config, options)) if cls is ModalEnvironment else cls
        # type.__call__ then runs the subclass's __init__ with the same arguments.
        return super().__new__(target)

    def _open_channel(self, argv: Sequence[str]) -> ChannelStream:
        raise NotImplementedError  # direct mode's stream; the gateway runs one request to its end

    @property
    def offers_channel(self) -> bool:
        """Direct mode runs the session server; managed mode one request per command."""
        return type(self)._open_channel is not ModalEnvironment._open_channel

    @classmethod
    def check_requirements(cls) -> list[str]:
        """What is missing here for the modal backend (empty when ready); for ``hermes-env doctor``."""
        import importlib.util

        problems = []
        if importlib.util.find_spec("modal") is None:
            problems.append("the modal SDK is not installed (direct mode): pip install 'modal>=1.6,<1.7'")
        if importlib.util.find_spec("httpx") is None:
            problems.append("httpx is not installed (managed mode): pip install 'httpx>=0.27'")
        try:
            from hermes_env_core.config import resolve_config

            # The options as the factory would build them (arguments aside).
            resolve_mode(resolve_config("modal").config)  # type: ignore[arg-type]
        except ConfigError as exc:
            problems.append(str(exc))
        return problems


def _merged(config: ModalConfig | None, options: dict[str, Any]) -> ModalConfig:
    # The same merge BaseEnvironment.__init__ does, so both see one config.
    if config is None:
        return ModalConfig(**options)
    return config.model_copy(update=options) if options else config


def _class_for(config: ModalConfig) -> type[ModalEnvironment]:
    if resolve_mode(config) == "managed":
        from .managed import ManagedModalEnvironment

        return ManagedModalEnvironment
    from .direct import DirectModalEnvironment

    return DirectModalEnvironment
