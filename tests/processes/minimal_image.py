"""A minimal docker image for tests, made with ``docker import`` from a few of this host's binaries.

bash, ``sleep`` (the container's main process) and the programs asked for,
each with the shared libraries ``ldd`` names; nothing else (no coreutils).
Tagged by a hash of its content, so it is built once per set of programs.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from typing import Any

__all__ = ["minimal_image"]

_PASSWD = b"root:x:0:0:root:/root:/bin/bash\n"
_GROUP = b"root:x:0:\n"


def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    return [word for line in out.splitlines() for word in line.split() if word.startswith("/")]


def _rootfs(programs: tuple[str, ...]) -> bytes:
    files: dict[str, str] = {}  # path in the image -> host file
    for name in ("bash", "sleep", *programs):
        host = shutil.which(name)
        if host is None:
            raise RuntimeError(f"{name} is not installed on this host")
        files[f"usr/bin/{name}"] = os.path.realpath(host)
        for lib in _libraries(host):
            files[lib.lstrip("/")] = os.path.realpath(lib)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add_dir(path: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(path)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, 0
            tar.addfile(info)

        def add_file(path: str, data: bytes, mode: int) -> None:
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))

        dirs = {"tmp", "root", "etc", "proc", "dev", "sys", "usr", "usr/bin"}
        for path in files:
            parent = os.path.dirname(path)
            while parent:
                dirs.add(parent)
                parent = os.path.dirname(parent)
        for d in sorted(dirs):
            add_dir(d, 0o1777 if d == "tmp" else 0o700 if d == "root" else 0o755)
        link = tarfile.TarInfo("bin")
        link.type, link.linkname, link.mtime = tarfile.SYMTYPE, "usr/bin", 0
        tar.addfile(link)
        for path, host in sorted(files.items()):
            with open(host, "rb") as f:
                add_file(path, f.read(), 0o755)
        add_file("etc/passwd", _PASSWD, 0o644)
        add_file("etc/group", _GROUP, 0o644)
    return buf.getvalue()


def minimal_image(client: Any, programs: tuple[str, ...] = ()) -> str:
    """The tag of an image holding bash, sleep and ``programs`` only; built unless it exists."""
    data = _rootfs(tuple(sorted(programs)))
    tag = "hermes-env-minimal:" + hashlib.sha256(data).hexdigest()[:16]
    try:
        client.images.get(tag)
        return tag
    except Exception:  # noqa: BLE001 - docker.errors.ImageNotFound: build it
        pass
    repo, _, version = tag.partition(":")
    client.api.import_image_from_data(
        data, repository=repo, tag=version,
        changes=['ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin', 'CMD ["/bin/bash"]'],
    )
    client.images.get(tag)
    return tag
