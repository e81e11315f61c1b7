"""``ModalEnvironment``: the class the ``modal`` backend name resolves to.

Creating one picks the mode from its config (``resolve_mode``) and builds the
class for it: ``DirectModalEnvironment`` (modal SDK) or
``ManagedModalEnvironment`` (HTTP gateway). Only the chosen one's client is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.environment.channel import ChannelStream
from hermes_env_core.environment.snapshot import CorruptSnapshotError, FilesRef, Snapshot
from hermes_env_core.errors import ConfigError, EnvironmentUnavailable, UnsupportedOperation, UsageError

from .config import ModalConfig, resolve_mode

__all__ = ["MODAL_IMAGE_KIND", "ModalEnvironment"]

#: A snapshot's files as a Modal filesystem snapshot: ``FilesRef.ref`` is the image id, no parts.
MODAL_IMAGE_KIND = "modal-image"


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

    # -- snapshots: Modal filesystem snapshots (direct mode) ----------------------------
    def snapshot_files(
        self, workdir: Path, name: str, *, paths: Sequence[str] | None, temporary: bool
    ) -> FilesRef | None:
        """Managed mode: the gateway keeps the sandbox's filesystem itself (direct mode overrides)."""
        raise UnsupportedOperation(
            f"modal: mode={self.mode!r} cannot snapshot or fork the sandbox's files: the managed gateway "
            "offers no filesystem snapshot of its own to name (persistent=True with a task_id keeps the files "
            "from one start to the next); use mode='direct' (Modal filesystem snapshots), or "
            "env.snapshot(files=False) for the session state alone"
        )

    @classmethod
    def start_from_snapshot(
        cls, snapshot: Snapshot, options: dict[str, Any], create: Callable[..., BaseEnvironment]
    ) -> BaseEnvironment:
        """A direct-mode sandbox created from the snapshot's Modal image (``image_id``); the core
        then restores the session state. The files keep their paths: nothing moved."""
        files = snapshot.files
        if files.kind != MODAL_IMAGE_KIND or not files.ref or files.parts:
            raise CorruptSnapshotError(
                f"snapshot {snapshot.name!r}: modal reads {MODAL_IMAGE_KIND!r} snapshots naming a Modal image "
                f"and no parts, not {files.kind!r} ref={files.ref!r} parts={list(files.parts)}; refused"
            )
        if options.get("mode") == "managed":
            raise UnsupportedOperation(
                f"modal: snapshot {snapshot.name!r} holds a Modal image ({files.ref}), which only direct mode "
                "can start a sandbox from; start it with mode='direct' (Modal credentials on this machine)"
            )
        task_id = options.get("task_id")
        if options.get("persistent") and task_id:
            from .config import default_snapshot_store
            from .snapshots import SnapshotStore

            store = SnapshotStore(options.get("snapshot_store") or default_snapshot_store())
            if store.get(f"direct:{task_id}") is not None:
                # Restoring by task id would win over the snapshot's image: refuse, not mix.
                raise UsageError(
                    f"modal: task {task_id!r} already has a persistent snapshot of its own, which a new sandbox "
                    f"of that task starts from; start snapshot {snapshot.name!r} with another task_id, or without "
                    "persistent=True"
                )
        try:
            return create(**{**options, "mode": "direct", "image_id": files.ref})
        except EnvironmentUnavailable as exc:
            if _image_not_found(exc):
                raise CorruptSnapshotError(
                    f"snapshot {snapshot.name!r}: its Modal image {files.ref} is gone (deleted, or past its "
                    f"snapshot_ttl); refused (remove the snapshot: hermes-env snapshots rm {snapshot.name})"
                ) from exc
            raise

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


def _image_not_found(exc: BaseException) -> bool:
    """Whether starting a sandbox failed because Modal does not know its image (NOT_FOUND)."""
    try:
        from modal.exception import NotFoundError
    except ImportError:
        return False
    return isinstance(exc.__cause__, NotFoundError)


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
