"""Helpers for pointing the real ``modal`` SDK at an emulator, inside one process.

What the 1.6 client caches per process (read from ``modal/client.py``, ``modal/config.py``,
``modal/_environments.py``, ``modal/sandbox/_common.py``):

- ``modal.Client.from_env()`` is a singleton (``_Client._client_from_env``). It is built
  on first use from ``MODAL_SERVER_URL`` / ``MODAL_TOKEN_ID`` / ``MODAL_TOKEN_SECRET`` and
  then reused for the life of the process, whatever the environment says later. Its
  channel to a stopped emulator is dead, so between emulators it has to be closed and
  cleared: ``reset_modal_client()``.
- Settings are read from ``os.environ`` at each ``config.get`` (so changing the env vars
  works without re-importing), except the profile and the ``~/.modal.toml`` contents
  (``MODAL_CONFIG_PATH``), which are read at import.
- ``ENVIRONMENT_CACHE`` keeps the environment settings (only the image builder version
  is used) per environment name for the process: harmless, every emulator answers the same.
- Module-level images, e.g. the default ``debian_slim`` image used when ``Sandbox.create``
  gets no ``image=``, stay hydrated with the first image id they got; the emulator uses
  content-addressed ids for built images and accepts unknown ids as an empty base image.
- Objects hydrated through a client (``App.lookup`` results, sandboxes, images) keep that
  client; after ``reset_modal_client()`` they raise ``ClientClosed``. Look them up again.

Connecting: the client opens its channel eagerly and retries an unreachable server for
about a minute (``create_channel_with_fallbacks``: 18 attempts, 63 s budget), so always
check ``emu.assert_alive()`` (a plain TCP connect, 2 s bound) before the SDK is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator


def reset_modal_client(timeout: float = 10.0) -> None:
    """Close and forget the SDK's process-wide ``Client.from_env()`` singleton (bounded)."""
    from modal._utils.async_utils import synchronizer
    from modal.client import _Client

    client = _Client._client_from_env
    _Client._client_from_env = None
    if client is None or client.is_closed():
        return
    loop = synchronizer._get_loop(start=False)
    if loop is None or loop.is_closed() or not loop.is_running():
        return
    future = asyncio.run_coroutine_threadsafe(client.close(), loop)
    try:
        future.result(timeout)
    except Exception:  # noqa: BLE001 - a client whose server is gone may fail to close
        future.cancel()  # it is forgotten either way


# Settings that would send the SDK elsewhere or down a path the emulator does not serve
# (OAuth credentials conflict with token credentials; MODAL_SANDBOX_V2=0 selects the V1 RPCs).
CONFLICTING_ENV = (
    "MODAL_PROFILE",
    "MODAL_ENVIRONMENT",
    "MODAL_SANDBOX_V2",
    "MODAL_IMAGE_BUILDER_VERSION",
    "MODAL_OAUTH_REFRESH_TOKEN",
    "MODAL_OAUTH_CLIENT_ID",
    "MODAL_OAUTH_CLIENT_SECRET",
    "MODAL_OAUTH_JWT_KEY",
)


@contextlib.contextmanager
def pointed_at(emu) -> Iterator[None]:
    """Set ``emu.env`` in ``os.environ`` with a fresh SDK client; restore both afterwards."""
    emu.assert_alive()
    saved = {k: os.environ.get(k) for k in (*emu.env, *CONFLICTING_ENV)}
    reset_modal_client()
    for key in CONFLICTING_ENV:
        os.environ.pop(key, None)
    os.environ.update(emu.env)
    try:
        yield
    finally:
        reset_modal_client()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
