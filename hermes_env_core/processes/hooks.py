"""How a registry hooks into an environment: ``close()`` kills its processes, the pool sees them.

The environment keeps a weak set of registries in ``_process_registries``. A
base class that creates that set itself also consults it (see the proposal in
``attach``); on one that does not, the two methods are hooked on the instance.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from ..environment.base import BaseEnvironment

if TYPE_CHECKING:
    from .registry import ProcessRegistry

__all__ = ["attach"]

log = logging.getLogger(__name__)


def attach(env: BaseEnvironment, registry: ProcessRegistry) -> None:
    """Link ``registry`` to ``env``: ``env.close()`` kills its processes; the pool sees them.

    What ``BaseEnvironment`` would do to make the hook unnecessary::

        self._process_registries = weakref.WeakSet()          # in __init__

        def _has_live_processes(self) -> bool:
            return any(r.has_live(self) for r in list(self._process_registries))

        # in close(), after self._closed = True and before self.cleanup():
        for r in list(self._process_registries):
            r.close_environment(self)
    """
    regs = env.__dict__.get("_process_registries")
    if regs is None:
        regs = weakref.WeakSet()
        env.__dict__["_process_registries"] = regs
        _hook_instance(env, regs)
    regs.add(registry)


def _hook_instance(env: BaseEnvironment, regs: weakref.WeakSet[ProcessRegistry]) -> None:
    ref = weakref.ref(env)
    cleanup = env.cleanup  # bound (or an instance's own): called once, after the processes

    def has_live_processes() -> bool:
        e = ref()
        return e is not None and any(r.has_live(e) for r in list(regs))

    def cleanup_after_processes(*args: Any, **kwargs: Any) -> None:
        e = ref()
        if e is not None:
            for r in list(regs):
                try:
                    r.close_environment(e)
                except Exception as exc:  # noqa: BLE001 - the environment must still be cleaned up
                    log.warning("hermes-env: closing background processes failed: %s", exc)
        cleanup(*args, **kwargs)

    env.__dict__["_has_live_processes"] = has_live_processes
    env.__dict__["cleanup"] = cleanup_after_processes
