"""A real Docker engine and a small local test image for the test suite.

::

    from tests.support.docker_engine import ensure_engine, ensure_test_image

    client = ensure_engine()              # docker.DockerClient, engine answering
    image = ensure_test_image(client)     # "hermes-env-test:latest"
    c = client.containers.run(image, ["sleep", "infinity"], detach=True,
                              network_mode="none", **HARDENED_RUN_KWARGS)

``ensure_engine()`` runs ``scripts/ensure-docker.sh`` (installs Debian's
``docker.io`` if ``dockerd`` is missing and starts the daemon detached with
no bridge network and no iptables) and returns a connected client.
``ensure_test_image()`` runs ``scripts/build-test-image.sh``, which imports a
~20 MB image assembled from the host's own binaries (no network, no
registry), and skips the build when the content is unchanged. Both are cached
per process, failures included, so a broken engine costs one attempt.

When the engine or the image cannot be had: in CI (``CI=true``) they raise
``DockerEngineUnavailable`` so the test fails; elsewhere they call
``pytest.skip`` with the reason.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "DockerEngineUnavailable",
    "ensure_engine",
    "ensure_test_image",
    "in_ci",
    "TEST_IMAGE_TAG",
    "TEST_IMAGE_LABEL",
    "HARDENED_RUN_KWARGS",
    "ENSURE_SCRIPT",
    "BUILD_SCRIPT",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
ENSURE_SCRIPT = REPO_ROOT / "scripts" / "ensure-docker.sh"
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-test-image.sh"

TEST_IMAGE_TAG = "hermes-env-test:latest"
TEST_IMAGE_LABEL = "hermes-env.test-image"

# The confinement the tests run containers with (add network_mode="none").
HARDENED_RUN_KWARGS: dict[str, Any] = {
    "cap_drop": ["ALL"],
    "security_opt": ["no-new-privileges"],
    "pids_limit": 64,
    "mem_limit": "256m",
    "tmpfs": {"/tmp": "size=64m"},
}

# Generous: the first run on a fresh machine installs docker.io with apt.
_ENSURE_TIMEOUT_S = 600
_BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_client: Any = None
_engine_error: str | None = None
_images: dict[str, str] = {}
_image_errors: dict[str, str] = {}


class DockerEngineUnavailable(RuntimeError):
    """The Docker engine could not be started or reached, or the test image not built."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _unavailable(reason: str) -> NoReturn:
    if in_ci():
        raise DockerEngineUnavailable(reason)
    import pytest

    pytest.skip(reason)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_script(script: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _start_engine() -> Any:
    """Return a connected client, or raise DockerEngineUnavailable."""
    try:
        import docker
    except ImportError as exc:
        raise DockerEngineUnavailable(f"the docker SDK is not installed: {exc}") from exc
    try:
        proc = _run_script(ENSURE_SCRIPT, timeout=_ENSURE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DockerEngineUnavailable(f"{ENSURE_SCRIPT.name} did not complete: {exc}") from exc
    if proc.returncode != 0:
        raise DockerEngineUnavailable(
            f"{ENSURE_SCRIPT.name} exited {proc.returncode}:\n{_tail(proc.stderr + proc.stdout)}"
        )
    try:
        # version="auto": Debian bookworm's engine speaks API 1.41, older
        # than the SDK's default.
        client = docker.from_env(version="auto", timeout=120)
        client.ping()
    except Exception as exc:  # docker.errors.DockerException, requests errors
        raise DockerEngineUnavailable(f"cannot connect to the Docker engine: {exc}") from exc
    return client


def ensure_engine() -> Any:
    """Start the engine if needed and return a connected ``docker.DockerClient``.

    Cached per process. In CI a failure raises ``DockerEngineUnavailable``;
    elsewhere it skips the calling test.
    """
    global _client, _engine_error
    with _lock:
        if _client is None and _engine_error is None:
            try:
                _client = _start_engine()
            except DockerEngineUnavailable as exc:
                _engine_error = str(exc)
        client, error = _client, _engine_error
    if error is not None:
        _unavailable(f"Docker engine unavailable: {error}")
    return client


def _build_image(client: Any, tag: str) -> str:
    try:
        proc = _run_script(BUILD_SCRIPT, tag, timeout=_BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DockerEngineUnavailable(f"{BUILD_SCRIPT.name} did not complete: {exc}") from exc
    if proc.returncode != 0:
        raise DockerEngineUnavailable(
            f"{BUILD_SCRIPT.name} exited {proc.returncode}:\n{_tail(proc.stderr + proc.stdout)}"
        )
    try:
        client.images.get(tag)
    except Exception as exc:
        raise DockerEngineUnavailable(f"image {tag} missing after the build: {exc}") from exc
    return tag


def ensure_test_image(client: Any = None, tag: str = TEST_IMAGE_TAG) -> str:
    """Build (or reuse) the local test image and return its tag.

    ``client`` defaults to ``ensure_engine()``. Cached per process and tag.
    In CI a failure raises ``DockerEngineUnavailable``; elsewhere it skips.
    """
    if client is None:
        client = ensure_engine()
    with _lock:
        if tag not in _images and tag not in _image_errors:
            try:
                _images[tag] = _build_image(client, tag)
            except DockerEngineUnavailable as exc:
                _image_errors[tag] = str(exc)
        image, error = _images.get(tag), _image_errors.get(tag)
    if error is not None:
        _unavailable(f"Docker test image unavailable: {error}")
    assert image is not None
    return image
