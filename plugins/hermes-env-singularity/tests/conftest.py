"""Fixtures for the singularity plugin's tests: the real apptainer and offline test images.

apptainer is found on PATH; when it is missing the project's installer runs.
Still missing: in CI (``CI=true``) the tests that need it fail; elsewhere they
skip, saying why. Images are built from this host's binaries once per session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_ROOT = Path(__file__).resolve().parents[1]
REPO_ROOT = PLUGIN_ROOT.parents[1]
TESTS_DIR = Path(__file__).resolve().parent
for p in (PLUGIN_ROOT, TESTS_DIR):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from hermes_env_singularity.runtime import Runtime, RuntimeNotFoundError, client_env, find_runtime
from singularity_support import build_docker_archive, build_rootfs

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
INSTALLER = REPO_ROOT / "scripts" / "install-apptainer.sh"


def _find_or_install() -> tuple[Runtime | None, str]:
    try:
        return find_runtime(), ""
    except RuntimeNotFoundError as exc:
        missing = str(exc)
    if not INSTALLER.is_file():
        return None, f"{missing} (and {INSTALLER} is not there)"
    if os.geteuid() != 0:
        return None, f"{missing} (the installer {INSTALLER} needs root)"
    proc = subprocess.run(["bash", str(INSTALLER)], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    try:
        return find_runtime(), ""
    except RuntimeNotFoundError:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"{missing}; {INSTALLER} exited {proc.returncode}: {' | '.join(tail)}"


@pytest.fixture(scope="session")
def runtime() -> Runtime:
    """The real apptainer (installed by the project's script if missing)."""
    found, why = _find_or_install()
    if found is None:
        if IN_CI:
            pytest.fail(f"apptainer is required in CI and is missing: {why}", pytrace=False)
        pytest.skip(f"apptainer not available: {why}")
    return found


@pytest.fixture(scope="session")
def images_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("singularity-images")


@pytest.fixture(scope="session")
def rootfs(images_dir: Path) -> Path:
    return build_rootfs(images_dir / "rootfs")


@pytest.fixture(scope="session")
def sif(runtime: Runtime, rootfs: Path, images_dir: Path) -> Path:
    """One SIF built from the host-binary rootfs, shared by the whole session."""
    out = images_dir / "test.sif"
    proc = runtime.run(["build", "--force", str(out), str(rootfs)], env=client_env(), timeout=600)
    assert proc.returncode == 0, f"apptainer build of the test SIF failed: {proc.stderr[-2000:]}"
    return out


@pytest.fixture(scope="session")
def docker_archive(rootfs: Path, images_dir: Path) -> Path:
    return build_docker_archive(rootfs, images_dir / "test-image.tar")


@pytest.fixture(scope="session")
def sandbox(runtime: Runtime, sif: Path, images_dir: Path) -> Path:
    out = images_dir / "sandbox"
    proc = runtime.run(["build", "--sandbox", "--force", str(out), str(sif)], env=client_env(), timeout=600)
    assert proc.returncode == 0, f"apptainer build --sandbox failed: {proc.stderr[-2000:]}"
    return out
