"""Did a command that had no input visibly want some?

A command runs with stdin at end of input and no controlling terminal, so a
prompt fails at once instead of hanging; what it prints then is the only
trace. These are the messages common tools print in that case.
"""

from __future__ import annotations

import re

__all__ = ["wanted_input"]

_SIGNS = re.compile(
    "|".join(
        [
            r"EOFError: EOF when reading a line",  # python input()
            r"/dev/tty: No such device or address",  # opening the terminal without one
            r"a terminal is required",  # sudo asking for a password
            r"no tty present",  # sudo, older wording
            r"(?:standard )?input is not a (?:terminal|tty)",  # vim, many CLIs
            r"the input device is not a TTY",  # docker run -t
            r"Inappropriate ioctl for device",  # a terminal call on a pipe (gpg, stty)
            r"\[Y/n\] Abort\.",  # apt-get without -y
            r"read error: 0: Bad file descriptor",  # bash read with stdin closed
        ]
    ),
    re.IGNORECASE,
)
_TAIL = 64 * 1024  # prompts come last: look at the end of the output only


def wanted_input(output: str) -> str | None:
    """The message in ``output`` showing that the command wanted input, if any."""
    m = _SIGNS.search(output[-_TAIL:])
    return m.group(0) if m else None
