"""Finding the apptainer (or singularity) binary and calling it.

Every call runs with the environment from ``client_env()``: apptainer's own
settings and HOME (instances are recorded under ``$HOME/.apptainer``), never
the caller's other variables, which would leak into the container.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hermes_env_core.errors import EnvironmentUnavailable

__all__ = ["RUNTIME_NAMES", "Runtime", "RuntimeNotFoundError", "client_env", "find_runtime", "run_group"]

#: tried in this order when no executable is configured
RUNTIME_NAMES: tuple[str, ...] = ("apptainer", "singularity")

INSTALL_HINT = (
    "install Apptainer (Debian/Ubuntu/Fedora package 'apptainer', or SingularityCE), "
    "or set the singularity backend's 'executable' option to its path"
)

# Variables of the caller that the apptainer client itself needs.
_CLIENT_VARS = ("HOME", "PATH", "USER", "LOGNAME", "TMPDIR", "XDG_RUNTIME_DIR", "LANG", "LC_ALL")
_CLIENT_PREFIXES = ("APPTAINER_", "SINGULARITY_")


class RuntimeNotFoundError(EnvironmentUnavailable):
    """Neither apptainer nor singularity (nor the configured binary) can be found."""


@dataclass(frozen=True)
class Runtime:
    """One apptainer-compatible binary, optionally with its own ``apptainer.conf``."""

    path: str
    config_file: str | None = None

    @property
    def flavor(self) -> str:
        """'apptainer' or 'singularity', from the binary's name."""
        base = os.path.basename(os.path.realpath(self.path))
        return "singularity" if "singularity" in base else "apptainer"

    def argv(self, *args: str) -> list[str]:
        # -s: errors only, so that INFO lines never mix into a command's output.
        conf = ["-c", self.config_file] if self.config_file else []
        return [self.path, "-s", *conf, *args]

    def run(
        self, args: Sequence[str], *, env: Mapping[str, str], timeout: float | None = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``apptainer -s ARGS`` to completion; raise if it cannot be started or hangs."""
        try:
            return run_group(self.argv(*args), env=env, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise EnvironmentUnavailable(
                f"singularity: '{' '.join(args[:2])}' did not finish in {timeout:g}s"
            ) from exc
        except OSError as exc:
            raise EnvironmentUnavailable(f"singularity: cannot run {self.path}: {exc}") from exc

    def version(self, env: Mapping[str, str] | None = None) -> str:
        proc = self.run(["--version"], env=env or client_env(), timeout=30)
        if proc.returncode != 0:
            raise EnvironmentUnavailable(
                f"singularity: '{self.path} --version' failed (exit {proc.returncode}): {last_error(proc.stderr)}"
            )
        return proc.stdout.strip()


def run_group(
    argv: Sequence[str], *, env: Mapping[str, str], timeout: float | None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own process group, capturing text; on timeout kill the whole group."""
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env=dict(env),
        cwd="/",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # apptainer's helpers (starter, mksquashfs) would outlive a plain kill.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def find_runtime(executable: str | None = None, *, path: str | None = None) -> Runtime:
    """The configured binary, else ``apptainer``, else ``singularity`` on PATH."""
    search = path if path is not None else os.environ.get("PATH", os.defpath)
    if executable:
        expanded = os.path.expanduser(executable)
        if os.sep in expanded:
            if os.path.isfile(expanded) and os.access(expanded, os.X_OK):
                return Runtime(os.path.abspath(expanded))
            raise RuntimeNotFoundError(
                f"singularity: the configured executable {executable!r} is not an executable file; {INSTALL_HINT}"
            )
        found = shutil.which(expanded, path=search)
        if found is None:
            raise RuntimeNotFoundError(
                f"singularity: the configured executable {executable!r} is not on PATH; {INSTALL_HINT}"
            )
        return Runtime(found)
    for name in RUNTIME_NAMES:
        found = shutil.which(name, path=search)
        if found is not None:
            return Runtime(found)
    raise RuntimeNotFoundError(
        f"singularity: neither 'apptainer' nor 'singularity' is on PATH ({search}); {INSTALL_HINT}"
    )


def client_env(extra: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the apptainer client runs with: its own settings, nothing for the container."""
    src = os.environ if environ is None else environ
    env = {k: v for k, v in src.items() if k in _CLIENT_VARS or k.startswith(_CLIENT_PREFIXES)}
    env.setdefault("PATH", os.defpath)
    if extra:
        env.update(extra)
    return env


def last_error(stderr: str, lines: int = 3) -> str:
    """The last few meaningful lines of apptainer's stderr, for an error message."""
    kept = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:]) or "(no message)"
