"""What an emulated sandbox's image looks like to the daemon: its ``/etc/shells``, and whether it has bash.

The daemon runs every ``process.exec`` command, and every session, with the
shell ``common.GetShell()`` picks (daytonaio/daytona
``apps/daemon/pkg/common/get_shell_linux.go``): it greps the non-comment lines
of ``/etc/shells`` and takes ``/usr/bin/zsh``, else ``/bin/zsh``, else
``/usr/bin/bash``, else ``/bin/bash``, else ``$SHELL``, else ``sh``. The
command text is not an argument: ``buildExecCmd`` (``apps/daemon/pkg/toolbox/
process/execute_linux.go``) starts that shell with no arguments and writes
the command to its stdin ("to avoid OS ARG_MAX limits"). The SDK says the same
(daytona 0.226.1 ``_sync/process.py``, ``Process.exec`` docstring: "run by
the first available of zsh, bash or sh in the sandbox, which is zsh in the
default snapshots").

Sandboxes here are local processes, not containers, so an image is a profile:
the ``/etc/shells`` lines the daemon would read, and whether ``bash`` is on
the ``PATH`` its commands see. zsh is not installed on this machine; when an
image's shell is zsh and no zsh is found, ``dash`` stands in for it (what
matters to a client is that it is not bash and that it reads the command
from stdin).
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEBIAN", "DEFAULT_PROFILES", "DEFAULT_SNAPSHOT_PROFILE", "NO_BASH", "ImageProfile", "profile_for"]


@dataclass(frozen=True)
class ImageProfile:
    """``etc_shells``: the image's ``/etc/shells`` lines; ``has_bash``: bash is on its PATH."""

    etc_shells: tuple[str, ...]
    has_bash: bool = True
    #: ``$SHELL`` in the daemon's environment (consulted only when /etc/shells names no zsh or bash)
    shell_env: str | None = None

    def daemon_shell(self) -> str:
        """The path ``GetShell()`` picks (get_shell_linux.go: zsh, then bash, then $SHELL, then sh)."""
        listed = "\n".join(line for line in self.etc_shells if line.strip() and not line.startswith("#"))
        if not listed:
            return "sh"  # grep found nothing: exit status 1, GetShell returns "sh"
        for candidate in ("/usr/bin/zsh", "/bin/zsh", "/usr/bin/bash", "/bin/bash"):
            if candidate in listed:  # strings.Contains, as the daemon does
                return candidate
        return self.shell_env or "sh"


# Daytona's default snapshot (daytonaio/sandbox) installs zsh: commands run in zsh.
DEFAULT_SNAPSHOT_PROFILE = ImageProfile(("/bin/sh", "/bin/bash", "/usr/bin/bash", "/bin/zsh", "/usr/bin/zsh"))
# Debian-based images (python:3.12-slim, debian, ubuntu): bash from base-files' /etc/shells.
DEBIAN = ImageProfile(("/bin/sh", "/usr/bin/sh", "/bin/bash", "/usr/bin/bash", "/bin/rbash", "/usr/bin/rbash"))
# Alpine and busybox images: /etc/shells lists ash only, and there is no bash at all.
NO_BASH = ImageProfile(("/bin/sh", "/bin/ash"), has_bash=False)

DEFAULT_PROFILES: dict[str, ImageProfile] = {
    "daytonaio/sandbox": DEFAULT_SNAPSHOT_PROFILE,
    "python": DEBIAN,
    "debian": DEBIAN,
    "ubuntu": DEBIAN,
    "node": DEBIAN,
    "alpine": NO_BASH,
    "busybox": NO_BASH,
}


def profile_for(image: str | None, profiles: dict[str, ImageProfile], default: ImageProfile) -> ImageProfile:
    """The profile of ``image`` (matched on its repository name without tag), else ``default``."""
    if not image:
        return default
    repo = image.rsplit("@", 1)[0]
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        repo = repo[: len(repo) - len(last)] + last.split(":", 1)[0]
    for key in (repo, repo.rsplit("/", 1)[-1]):
        if key in profiles:
            return profiles[key]
    return default


_NO_BASH_LOCK = threading.Lock()


def executable(shell: str) -> str:
    """What runs for the daemon's shell path on this machine (dash stands in for a missing zsh)."""
    if os.path.basename(shell) == "zsh" and not os.path.exists(shell) and shutil.which("zsh") is None:
        return shutil.which("dash") or "sh"
    return shell


def path_without_bash(root: Path, path: str) -> str:
    """A PATH with every command of ``path`` but bash (symlinks in ``root/bin``), made once."""
    bindir = root / "bin-without-bash"
    with _NO_BASH_LOCK:
        if not bindir.is_dir():
            tmp = root / f"bin-without-bash.{os.getpid()}.tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            for d in path.split(os.pathsep):
                try:
                    names = os.listdir(d)
                except OSError:
                    continue
                for name in names:
                    if name in ("bash", "rbash", "zsh") or (tmp / name).exists():
                        continue
                    full = os.path.join(d, name)
                    if os.access(full, os.X_OK) and not os.path.isdir(full):
                        os.symlink(full, tmp / name)
            tmp.rename(bindir)
    return str(bindir)
