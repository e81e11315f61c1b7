"""Stand-in for ``/__modal/.bin/modal-sandbox-fs-tools``, the helper that Modal's containers ship.

``Sandbox.filesystem`` (read_bytes/read_text/write_bytes/write_text/copy_*/list_files/stat/
make_directory/remove) is implemented by the SDK as an exec of that helper with one JSON
argument, e.g. ``{"ReadFile": {"path": "/x"}}``: file contents travel over the exec's
stdout (reads) or stdin (writes); results are JSON on stdout; failures are a JSON
``{"error_kind", "message"}`` object on stderr with a non-zero exit. The emulator's router
runs this script in its place. ``Watch`` is not emulated.

Paths are translated like the emulator's exec workdirs: the sandbox workdir prefix maps
onto the sandbox directory (see ``state.py``).
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import shutil
import stat as stat_mod
import sys

ROOT = os.environ.get("MODAL_EMULATOR_SANDBOX_ROOT", "/")
WORKDIR = (os.environ.get("MODAL_EMULATOR_SANDBOX_WORKDIR") or "").rstrip("/")
CHUNK = 256 * 1024


class FsError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


_ERRNO_KINDS = {
    errno.ENOENT: "NotFound",
    errno.ENOTDIR: "NotDirectory",
    errno.EISDIR: "IsDirectory",
    errno.EACCES: "PermissionDenied",
    errno.EPERM: "PermissionDenied",
    errno.EEXIST: "PathAlreadyExists",
    errno.ENOTEMPTY: "DirectoryNotEmpty",
}


def host(path: str) -> str:
    if WORKDIR and (path == WORKDIR or path.startswith(WORKDIR + "/")):
        return os.path.join(ROOT, path[len(WORKDIR) :].lstrip("/"))
    return path


def info(remote: str, local: str) -> dict:
    st = os.lstat(local)
    if stat_mod.S_ISLNK(st.st_mode):
        kind = "symlink"
    elif stat_mod.S_ISDIR(st.st_mode):
        kind = "directory"
    else:
        kind = "file"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return {
        "name": os.path.basename(remote.rstrip("/")) or "/",
        "path": remote,
        "type": kind,
        "size": st.st_size,
        "mode": st.st_mode,
        "permissions": stat_mod.filemode(st.st_mode),
        "owner": owner,
        "group": group,
        "modified_time": st.st_mtime,
        "symlink_target": os.readlink(local) if kind == "symlink" else None,
    }


def run(command: dict) -> None:
    ((op, args),) = command.items()
    remote = args.get("path", "")
    local = host(remote)
    out = sys.stdout.buffer
    if op == "ReadFile":
        if os.path.isdir(local):
            raise FsError("IsDirectory", "Is a directory")
        with open(local, "rb") as f:
            while chunk := f.read(CHUNK):
                out.write(chunk)
    elif op == "WriteFile":
        if os.path.isdir(local):
            raise FsError("IsDirectory", "Is a directory")
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        with open(local, "wb") as f:
            while chunk := sys.stdin.buffer.read(CHUNK):
                f.write(chunk)
    elif op == "ListFiles":
        entries = [
            info(os.path.join(remote, name), os.path.join(local, name))
            for name in sorted(os.listdir(local))
        ]
        out.write(json.dumps(entries).encode())
    elif op == "Stat":
        out.write(json.dumps(info(remote, local)).encode())
    elif op == "MakeDirectory":
        if args.get("parents", True):
            os.makedirs(local, exist_ok=True)
        else:
            os.mkdir(local)
    elif op == "Remove":
        if os.path.isdir(local) and not os.path.islink(local):
            if args.get("recursive"):
                shutil.rmtree(local)
            else:
                os.rmdir(local)
        else:
            os.remove(local)
    else:
        raise FsError("NotSupported", f"{op} is not supported by the emulator")
    out.flush()


def main() -> int:
    try:
        run(json.loads(sys.argv[1]))
        return 0
    except FsError as exc:
        kind, message = exc.kind, exc.message
    except OSError as exc:
        kind, message = (
            _ERRNO_KINDS.get(exc.errno or 0, "Other"),
            exc.strerror or str(exc),
        )
    sys.stderr.write(json.dumps({"error_kind": kind, "message": message}))
    return 1


if __name__ == "__main__":
    sys.exit(main())
