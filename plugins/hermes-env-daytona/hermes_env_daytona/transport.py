"""``FileSyncTransport`` over the Daytona file API: a push is one tar uploaded in
one request and extracted by one command; a pull is one tar made by one command
and downloaded in one request.
"""

from __future__ import annotations

import io
import os
import posixpath
import secrets
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, BinaryIO

from hermes_env_core.errors import EnvironmentUnavailable
from hermes_env_core.sync.transport import CommandFailedError, TransportError

from . import _sdk

if TYPE_CHECKING:
    from .backend import DaytonaEnvironment

__all__ = ["DaytonaSyncTransport"]

_ARGV_BUDGET = 64 * 1024  # bytes of quoted names per delete command


class DaytonaSyncTransport:
    """Moves tar streams into and out of one environment's sandbox.

    Relative remote roots are taken from the sandbox user's home. Staging
    files live in ``~/.cache/hermes-env`` (the file API may be confined to
    the home directory) and are removed by the same command that uses them.
    """

    def __init__(self, env: DaytonaEnvironment) -> None:
        self._env = env

    # -- helpers --------------------------------------------------------------
    def _root(self, remote_root: str) -> str:
        if remote_root.startswith("/"):
            return remote_root
        home = self._call("asking for the home directory", self._env.home)
        return posixpath.normpath(posixpath.join(home, remote_root or "."))

    def _staging(self, suffix: str) -> str:
        home = self._call("asking for the home directory", self._env.home)
        return f"{home}/.cache/hermes-env/sync-{secrets.token_hex(8)}{suffix}"

    def _call(self, what: str, fn, *args):  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except EnvironmentUnavailable as exc:
            raise TransportError(f"{what}: {exc}", transient=_transient(exc)) from exc
        except Exception as exc:
            if _sdk.is_sdk_error(exc):
                mapped = self._env._error(exc, what)
                raise TransportError(str(mapped), transient=_transient(exc)) from exc
            raise

    def _run(self, script: str, what: str) -> str:
        """Run ``script`` with bash; its output, or ``CommandFailedError``."""
        res = self._call(what, self._env.run_script, script, what)
        code = -1 if res.exit_code is None else int(res.exit_code)
        if code != 0:
            raise CommandFailedError(script, code, res.result or "")
        return res.result or ""

    # -- FileSyncTransport ------------------------------------------------------
    def upload(self, remote_root: str, archive: BinaryIO, size: int | None) -> None:
        root = self._root(remote_root)
        staged = self._staging(".tar")
        sb = self._call("starting the sandbox", self._env._ready)
        what = f"uploading {size} bytes" if size is not None else "uploading an archive"
        self._call(f"{what} to {staged}", sb.fs.upload_file_stream, archive, staged)
        q, r = shlex.quote(staged), shlex.quote(root)
        self._run(
            f"mkdir -p -- {r} && tar -x -o -f {q} -C {r}; rc=$?; rm -f -- {q}; exit $rc",
            f"extracting {staged} under {root}",
        )

    def delete(self, remote_root: str, files: Sequence[str], dirs: Sequence[str] = ()) -> None:
        root = shlex.quote(self._root(remote_root))
        head = f"cd -- {root} 2>/dev/null || exit 0"
        if files:
            quoted = " ".join(shlex.quote(f) for f in files)
            if len(quoted) <= _ARGV_BUDGET:
                self._run(f"{head}; rm -f -- {quoted}", "deleting synced files")
            else:
                staged = self._staging(".list")
                payload = b"".join(os.fsencode(f) + b"\0" for f in files)
                sb = self._call("starting the sandbox", self._env._ready)
                self._call(f"uploading {staged}", sb.fs.upload_file, payload, staged)
                q = shlex.quote(staged)
                self._run(f"{head}; xargs -0 rm -f -- <{q}; rc=$?; rm -f -- {q}; exit $rc", "deleting synced files")
        batch: list[str] = []
        used = 0
        for d in [*dirs, None]:
            if d is not None:
                batch.append(shlex.quote(d))
                used += len(batch[-1]) + 1
            if batch and (d is None or used > _ARGV_BUDGET):
                # rmdir leaves directories the sandbox put files in.
                self._run(f"{head}; rmdir -- {' '.join(batch)} 2>/dev/null; exit 0", "removing synced directories")
                batch, used = [], 0

    def download(self, remote_root: str, subpath: str | None = None, exclude: Sequence[str] = ()) -> BinaryIO | None:
        root = shlex.quote(self._root(remote_root))
        staged = self._staging(".tar")
        q = shlex.quote(staged)
        target = "."
        parts = [f"cd -- {root} 2>/dev/null || {{ echo absent; exit 0; }}"]
        if subpath:
            target = shlex.quote(subpath)
            parts.append(f"{{ [ -e {target} ] || [ -L {target} ]; }} || {{ echo absent; exit 0; }}")
        excl = " ".join(f"--exclude={shlex.quote(p)}" for p in (*exclude, posixpath.basename(staged)))
        parts.append(f"mkdir -p -- {shlex.quote(posixpath.dirname(staged))}")
        # GNU tar exits 1 when a file changed while it was read; the archive is still whole.
        parts.append(f"tar -c -f {q} {excl} -- {target}; rc=$?; [ $rc -eq 1 ] && rc=0; exit $rc")
        if self._run("; ".join(parts), f"archiving {remote_root}").strip() == "absent":
            return None
        sb = self._call("starting the sandbox", self._env._ready)
        try:
            data = self._call(f"downloading {staged}", sb.fs.download_file, staged)
        finally:
            try:
                self._run(f"rm -f -- {q}", f"removing {staged}")
            except TransportError:
                pass
        return io.BytesIO(data)


def _transient(exc: BaseException) -> bool:
    """Connection trouble and overload are worth a retry; a refused key or a quota is not."""
    cause: BaseException | None = exc
    for _ in range(5):
        if cause is None:
            break
        status = getattr(cause, "status_code", None)
        if status in (401, 403, 404):
            return False
        if status in (408, 429) or (isinstance(status, int) and status >= 500):
            return True
        cause = cause.__cause__
    return "cannot reach" in str(exc)
