"""Snapshots of a persistent overlay: a tar of its ``upper`` directory, and a new overlay made from one.

The copy is GNU tar with numeric owners, permissions, symbolic links, extended
attributes (overlayfs keeps opaque directories in them) and whiteouts (0/0
character devices, how overlayfs records a file deleted from the image).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

from hermes_env_core.environment.snapshot import CorruptSnapshotError
from hermes_env_core.errors import EnvironmentUnavailable, UsageError

__all__ = ["OVERLAY_KIND", "OVERLAY_PART", "archive_overlay", "check_overlay_archive", "overlay_path", "unpack_overlay"]

OVERLAY_KIND = "overlay"
OVERLAY_PART = "overlay.tar.gz"
_TAR_FLAGS = ("--xattrs", "--xattrs-include=*", "--numeric-owner", "--sparse")


def overlay_path(overlay_dir: str | None, task_id: str) -> str:
    """The persistent overlay directory of ``task_id`` (not created)."""
    root = os.path.expanduser(
        overlay_dir or os.path.join(os.path.expanduser("~"), ".cache", "hermes-env", "singularity", "overlays")
    )
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", task_id)[:40]
    return os.path.join(root, f"{slug}-{hashlib.sha256(task_id.encode()).hexdigest()[:8]}")


def _tar(args: list[str], what: str) -> None:
    tar = shutil.which("tar")
    if tar is None:
        raise EnvironmentUnavailable(f"singularity: {what} needs GNU tar on this host's PATH")
    proc = subprocess.run([tar, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
    # 1: a file changed while it was read (a background process writing): the copy is still whole.
    if proc.returncode not in (0, 1):
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise EnvironmentUnavailable(f"singularity: {what} failed (tar exit {proc.returncode}): {tail}")


def archive_overlay(overlay: str, out: Path) -> int:
    """Write the overlay's ``upper`` directory (the container's changes) to ``out``; its size.

    Read while the instance runs: overlayfs forbids changing its upper directory from
    outside while mounted, never reading it, and a write made through the overlay is in
    the upper directory's own files at once. ``work/`` is overlayfs' scratch space, not kept.
    """
    upper = os.path.join(overlay, "upper")
    members = ["."] if os.path.isdir(upper) else []
    where = upper if members else overlay
    _tar(
        ["--create", "--file", str(out), "--use-compress-program", "gzip -1", *_TAR_FLAGS,
         "--directory", where, "--files-from", "/dev/null", *members],
        f"copying the overlay {overlay}",
    )
    return out.stat().st_size


def check_overlay_archive(path: Path, where: str) -> None:
    """Read it whole; refuse a member that could land outside the overlay, or a device other than a whiteout."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            links: set[str] = set()
            for m in tar:
                parts = [p for p in m.name.split("/") if p not in ("", ".")]
                name = "/".join(parts)
                if m.name.startswith("/") or ".." in parts:
                    raise CorruptSnapshotError(f"{where}: {path.name} holds an unsafe path {m.name!r}; refused")
                if any(name == link or name.startswith(link + "/") for link in links):
                    raise CorruptSnapshotError(f"{where}: {path.name} writes through a symbolic link ({m.name!r}); refused")
                if m.islnk() and (m.linkname.startswith("/") or ".." in m.linkname.split("/")):
                    raise CorruptSnapshotError(f"{where}: {path.name} holds a hard link out of it ({m.linkname!r}); refused")
                if m.isblk() or m.isfifo() or (m.ischr() and (m.devmajor, m.devminor) != (0, 0)):
                    raise CorruptSnapshotError(f"{where}: {path.name} holds a device file {m.name!r}; refused")
                if m.issym():
                    links.add(name)
                if m.isfile():
                    f = tar.extractfile(m)
                    assert f is not None
                    while f.read(1 << 20):
                        pass
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise CorruptSnapshotError(f"{where}: overlay archive {path.name} is damaged or truncated ({exc}); refused") from exc


def unpack_overlay(archive: Path, overlay: str) -> None:
    """Make ``overlay/upper`` from ``archive``; ``overlay`` must be new or empty."""
    if os.path.isdir(overlay) and os.listdir(overlay):
        raise UsageError(
            f"singularity: the overlay {overlay} already holds files; start from the snapshot with a new task_id "
            "(or none: one is made)"
        )
    os.makedirs(overlay, mode=0o700, exist_ok=True)
    upper = os.path.join(overlay, "upper")
    os.mkdir(upper, 0o755)
    owner = ["--same-owner"] if os.geteuid() == 0 else ["--no-same-owner"]
    _tar(
        ["--extract", "--file", str(archive), "--use-compress-program", "gzip", "--same-permissions", *owner,
         *_TAR_FLAGS, "--directory", upper],
        f"making the overlay {overlay} from the snapshot",
    )


def remove_overlay(overlay: str) -> None:
    """Remove an overlay directory (overlayfs leaves ``work/work`` mode 000) and its lock file."""

    for top, dirs, _ in os.walk(overlay):
        for d in dirs:
            path = os.path.join(top, d)
            if not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
    shutil.rmtree(overlay, ignore_errors=True)
    try:
        os.unlink(overlay + ".lock")
    except FileNotFoundError:
        pass
