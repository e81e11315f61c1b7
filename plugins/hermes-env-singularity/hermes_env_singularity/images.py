"""Turning the configured ``image`` into something ``instance start`` can use.

A SIF file or a sandbox directory is used as it is. Anything apptainer must
convert (``docker-archive:``, ``docker://`` and the other schemes) is built
once into a SIF cache: into a temporary file, renamed into place, under an
exclusive lock on a per-image lock file, so concurrent processes build it once.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from hermes_env_core.errors import ConfigError

from .runtime import Runtime, last_error, run_group

__all__ = ["BUILD_SCHEMES", "ImageBuildError", "ResolvedImage", "default_cache_dir", "ensure_sif", "resolve_image"]

#: sources that are converted into a cached SIF (everything else is a path)
BUILD_SCHEMES: tuple[str, ...] = (
    "docker://", "docker-archive:", "docker-daemon:", "oci://", "oci:", "oci-archive:", "oras://",
    "library://", "shub://", "http://", "https://",
)
# Local archives: the cache key follows the file (path, size, mtime), so a
# rebuilt tarball is converted again.
_FILE_SCHEMES = ("docker-archive:", "oci-archive:", "oci:")
_SLUG_RE = re.compile(r"[^A-Za-z0-9_.-]+")


class ImageBuildError(Exception):
    """``apptainer build`` failed or timed out; the message has its last lines."""


@dataclass(frozen=True)
class ResolvedImage:
    """What to start: ``source`` (a path or a reference) and how it was got."""

    source: str
    kind: str  # sif, sandbox, cached, built, direct
    built_s: float = 0.0
    waited_s: float = 0.0
    warning: str | None = None


def default_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    for var in ("APPTAINER_CACHEDIR", "SINGULARITY_CACHEDIR"):
        if env.get(var):
            return os.path.join(env[var], "hermes-env")
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hermes-env", "singularity", "sif")


def _needs_build(image: str) -> bool:
    return image.startswith(BUILD_SCHEMES)


def cache_key(image: str) -> str:
    """The cache file name for ``image``: a readable slug and a hash of what identifies it."""
    ident = image
    for scheme in _FILE_SCHEMES:
        if image.startswith(scheme):
            rest = image[len(scheme):]
            if scheme == "oci:":
                rest = rest.split(":", 1)[0]  # oci:DIR[:TAG]
            path = os.path.abspath(os.path.expanduser(rest))
            try:
                st = os.stat(path)
            except OSError as exc:
                raise ConfigError(f"singularity: image {image!r}: {path} cannot be read: {exc.strerror}") from exc
            ident = f"{scheme}{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
            break
    digest = hashlib.sha256(ident.encode()).hexdigest()[:20]
    tail = image.split("://", 1)[-1].rsplit("/", 1)[-1]
    slug = _SLUG_RE.sub("_", tail)[-40:].strip("_.") or "image"
    return f"{slug}-{digest}.sif"


def resolve_image(
    image: str,
    runtime: Runtime,
    *,
    cache_dir: str | None,
    env: Mapping[str, str],
    build_timeout: float,
    no_https: bool = False,
) -> ResolvedImage:
    """A SIF or sandbox to start ``image`` from; on a failed build, the reference itself with a warning."""
    if not _needs_build(image):
        path = os.path.abspath(os.path.expanduser(image))
        if os.path.isdir(path):
            if not os.path.isdir(os.path.join(path, ".singularity.d")):
                raise ConfigError(
                    f"singularity: image directory {path} is not an Apptainer sandbox (no .singularity.d); "
                    f"make one with 'apptainer build --sandbox DIR SOURCE' or a SIF with 'apptainer build X.sif {path}'"
                )
            return ResolvedImage(path, "sandbox")
        if os.path.isfile(path):
            return ResolvedImage(path, "sif")
        raise ConfigError(
            f"singularity: image {image!r} is not a file or directory, nor a reference of a known scheme "
            f"({', '.join(s.rstrip(':/') for s in BUILD_SCHEMES[:5])}, ...)"
        )
    cache = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir(env)))
    try:
        return ensure_sif(image, runtime, cache_dir=cache, env=env, build_timeout=build_timeout, no_https=no_https)
    except (ImageBuildError, OSError) as exc:
        reason = str(exc) if isinstance(exc, ImageBuildError) else f"{type(exc).__name__}: {exc}"
        return ResolvedImage(
            image,
            "direct",
            warning=(
                f"image {image} could not be built into the SIF cache ({reason}); running the reference "
                f"directly, which apptainer converts again at every start"
            ),
        )


def ensure_sif(
    image: str,
    runtime: Runtime,
    *,
    cache_dir: str,
    env: Mapping[str, str],
    build_timeout: float,
    no_https: bool = False,
) -> ResolvedImage:
    """The cached SIF of ``image``, built now if no process has built it yet."""
    os.makedirs(cache_dir, mode=0o755, exist_ok=True)
    final = os.path.join(cache_dir, cache_key(image))
    if os.path.isfile(final):
        return ResolvedImage(final, "cached")
    started = time.monotonic()
    fd = os.open(final + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _lock(fd, final, deadline=started + build_timeout + 60)
        waited = time.monotonic() - started
        if os.path.isfile(final):
            return ResolvedImage(final, "cached", waited_s=waited)  # another process built it meanwhile
        _remove_stale_builds(final)
        t0 = time.monotonic()
        _build(image, final, runtime, env=env, timeout=build_timeout, no_https=no_https)
        return ResolvedImage(final, "built", built_s=time.monotonic() - t0, waited_s=waited)
    finally:
        os.close(fd)  # releases the lock


def _remove_stale_builds(final: str) -> None:
    """Temporary files of builds that died: holding the lock, nobody else is writing one."""
    directory, base = os.path.split(final)
    for name in os.listdir(directory):
        if name.startswith(f".{base}.") and name.endswith(".tmp"):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def _lock(fd: int, what: str, *, deadline: float) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() > deadline:
            raise ImageBuildError(f"another process has been building {what} for too long (lock {what}.lock)")
        time.sleep(0.05)


def _build(image: str, final: str, runtime: Runtime, *, env: Mapping[str, str], timeout: float, no_https: bool) -> None:
    directory = os.path.dirname(final)
    tmp = os.path.join(directory, f".{os.path.basename(final)}.{os.getpid()}.tmp")
    args = ["build", "--force"]
    if no_https:
        args.append("--no-https")
    args += [tmp, image]
    try:
        try:
            proc = run_group(runtime.argv(*args), env=env, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ImageBuildError(f"'apptainer build' did not finish in {timeout:g}s") from exc
        if proc.returncode != 0 or not os.path.isfile(tmp):
            raise ImageBuildError(f"'apptainer build' exited {proc.returncode}: {last_error(proc.stderr)}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)  # atomic: readers see no file or the whole SIF
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
