"""Test images made offline from this host's binaries, and a registry on 127.0.0.1.

Nothing here reaches the network: the root filesystem is copied from the host
(bash, coreutils and friends plus the libraries ldd names), packed as a SIF,
as a ``docker save``-format tarball, and served by ``LocalRegistry`` over the
Docker registry HTTP API v2 for ``docker://`` references.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PLUGIN_ROOT = Path(__file__).resolve().parents[1]

# Commands the conformance suite and these tests run inside the container.
IMAGE_COMMANDS = (
    "bash", "cat", "head", "tail", "tr", "seq", "od", "wc", "sleep", "mkdir", "rmdir", "true", "false",
    "env", "ls", "rm", "setsid", "pkill", "pgrep", "ps", "base64", "id", "printf", "echo", "kill", "grep",
    "sed", "nproc", "timeout", "mv", "cp", "touch", "stat", "dd", "mkfifo", "sort", "ln",
)
IMAGE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HERMES_IMAGE_ENV": "from-image-config",
}


def build_rootfs(dest: Path, *, marker: str = "hermes-test-image", commands: Iterable[str] = IMAGE_COMMANDS) -> Path:
    """A minimal root filesystem with the host's binaries; ``/marker`` holds ``marker``."""
    dest.mkdir(parents=True, exist_ok=True)
    for d in ("etc", "tmp", "root", "usr/bin", "dev", "proc", "sys", "var/tmp"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    (dest / "tmp").chmod(0o1777)
    for name in commands:
        host = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if host is None:
            raise RuntimeError(f"test image: {name} is not installed on this host")
        _copy_with_libs(Path(host), dest)
    if not (dest / "bin").exists():
        (dest / "bin").symlink_to("usr/bin")
    sh = dest / "usr/bin/sh"
    if not sh.exists():
        # Without /bin/sh, apptainer builds an image without /.singularity.d.
        sh.symlink_to("bash")
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (dest / "etc/group").write_text("root:x:0:\n")
    (dest / "marker").write_text(marker + "\n")
    return dest


def _copy_with_libs(binary: Path, dest: Path) -> None:
    real = binary.resolve()
    target = dest / str(binary).lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        shutil.copy2(real, target)
    out = subprocess.run(["ldd", str(real)], capture_output=True, text=True).stdout
    for line in out.splitlines():
        for word in line.split():
            if word.startswith("/"):
                lib = dest / word.lstrip("/")
                if not lib.exists():
                    lib.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(Path(word).resolve(), lib)


def _layer_tar(rootfs: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(rootfs)):
            tar.add(rootfs / entry, arcname=entry)
    return buf.getvalue()


def _image_config(diff_id: str) -> bytes:
    return json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": [f"{k}={v}" for k, v in IMAGE_ENV.items()], "Cmd": ["/bin/bash"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        },
        sort_keys=True,
    ).encode()


def build_docker_archive(rootfs: Path, dest: Path, tag: str = "hermes/test:latest") -> Path:
    """A one-layer image tarball in ``docker save`` format (what ``docker-archive:`` reads)."""
    layer = _layer_tar(rootfs)
    layer_hex = hashlib.sha256(layer).hexdigest()
    config = _image_config("sha256:" + layer_hex)
    config_hex = hashlib.sha256(config).hexdigest()
    manifest = json.dumps(
        [{"Config": f"{config_hex}.json", "RepoTags": [tag], "Layers": [f"{layer_hex}/layer.tar"]}]
    ).encode()
    with tarfile.open(dest, "w") as tar:
        for name, data in ((f"{layer_hex}/layer.tar", layer), (f"{config_hex}.json", config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return dest


class LocalRegistry:
    """A read-only Docker registry (HTTP API v2) on 127.0.0.1 serving one image.

    ``requests`` counts manifest fetches, so a test can see how often the
    image was pulled.
    """

    MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"

    def __init__(self, rootfs: Path, repository: str = "hermes/test", tag: str = "latest") -> None:
        layer = gzip.compress(_layer_tar(rootfs), compresslevel=1, mtime=0)
        diff_id = "sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest()
        config = _image_config(diff_id)
        self.blobs = {"sha256:" + hashlib.sha256(b).hexdigest(): b for b in (layer, config)}
        layer_digest, config_digest = list(self.blobs)
        self.manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": self.MANIFEST_TYPE,
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "size": len(config), "digest": config_digest},
                "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                            "size": len(layer), "digest": layer_digest}],
            }
        ).encode()
        self.manifest_digest = "sha256:" + hashlib.sha256(self.manifest).hexdigest()
        self.repository, self.tag = repository, tag
        self.manifest_requests = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="test-registry", daemon=True)

    @property
    def reference(self) -> str:
        host, port = self._server.server_address[:2]
        return f"docker://{host}:{port}/{self.repository}:{self.tag}"

    def __enter__(self) -> LocalRegistry:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", ctype: str = "application/json", digest: str = "") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                if digest:
                    self.send_header("Docker-Content-Digest", digest)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                prefix = f"/v2/{registry.repository}/"
                if path in ("/v2", "/v2/"):
                    return self._send(200, b"{}")
                if path.startswith(prefix + "manifests/"):
                    ref = path[len(prefix + "manifests/"):]
                    if ref not in (registry.tag, registry.manifest_digest):
                        return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}')
                    with registry._lock:
                        registry.manifest_requests += 1
                    return self._send(200, registry.manifest, registry.MANIFEST_TYPE, registry.manifest_digest)
                if path.startswith(prefix + "blobs/"):
                    digest = path[len(prefix + "blobs/"):]
                    blob = registry.blobs.get(digest)
                    if blob is None:
                        return self._send(404, b'{"errors":[{"code":"BLOB_UNKNOWN"}]}')
                    return self._send(200, blob, "application/octet-stream", digest)
                return self._send(404, b"{}")

            do_HEAD = do_GET

        return Handler
