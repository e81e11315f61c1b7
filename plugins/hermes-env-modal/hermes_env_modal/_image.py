"""What a sandbox image must have, checked once when a sandbox starts.

bash >= 4.4 (the session wrapper uses ``mapfile -d``, ``${var@Q}`` and
``declare -p`` of arrays), ``/proc`` (kills find the command's processes
there), and tar and gzip when files are synced. The check runs under ``sh``,
so an image without bash gets a clear error instead of a failed command.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHECK_SCRIPT", "ImageFacts", "parse_check", "requirement_message"]

CHECK_SCRIPT = r"""m=
for p in bash tar gzip; do command -v "$p" >/dev/null 2>&1 || m="$m,$p"; done
[ -r /proc/self/cmdline ] || m="$m,/proc"
v=
command -v bash >/dev/null 2>&1 && v=$(bash -c 'echo "${BASH_VERSINFO[0]}.${BASH_VERSINFO[1]}"' 2>/dev/null)
s=tmp
[ -d /dev/shm ] && [ -w /dev/shm ] && [ -x /dev/shm ] && s=shm
echo "hermes-image-check missing=$m bash=$v state=$s"
"""

MIN_BASH = (4, 4)


@dataclass(frozen=True)
class ImageFacts:
    missing: tuple[str, ...]
    bash_version: tuple[int, int] | None
    shm: bool

    def problems(self, *, needs_tar: bool) -> list[str]:
        """What stops hermes-env from working in this image (empty when fine)."""
        out = []
        if "bash" in self.missing:
            out.append("no bash")
        elif self.bash_version is not None and self.bash_version < MIN_BASH:
            out.append(f"bash {self.bash_version[0]}.{self.bash_version[1]} (older than 4.4)")
        if "/proc" in self.missing:
            out.append("no readable /proc")
        if needs_tar:
            out.extend(f"no {p} (needed by file sync)" for p in ("tar", "gzip") if p in self.missing)
        return out

    def warnings(self, *, needs_tar: bool) -> list[str]:
        if needs_tar:
            return []
        return [f"no {p}" for p in ("tar", "gzip") if p in self.missing]


def parse_check(output: str) -> ImageFacts | None:
    """The facts from the check's output line, or None when it did not run."""
    for line in output.splitlines():
        if not line.startswith("hermes-image-check "):
            continue
        fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
        missing = tuple(p for p in fields.get("missing", "").split(",") if p)
        version = None
        major, _, minor = fields.get("bash", "").partition(".")
        if major.isdigit() and minor.isdigit():
            version = (int(major), int(minor))
        return ImageFacts(missing=missing, bash_version=version, shm=fields.get("state") == "shm")
    return None


def requirement_message(image: str, problems: list[str]) -> str:
    return (
        f"modal: the sandbox image {image} cannot run hermes-env: {', '.join(problems)}. "
        "An image needs bash >= 4.4, a readable /proc, and tar and gzip for file sync "
        "(e.g. add `apt-get install -y bash tar gzip` to the image, or use python:3.12-slim or debian:bookworm-slim)"
    )
