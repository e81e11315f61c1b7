"""The bash the sandbox sends through ``execute()``, and the parsing of what comes back.

Every script runs in a subshell (the session's own state is never touched)
and answers with one header line carrying a per-call nonce; file contents and
the command's stdout and stderr travel base64-encoded after it, so nothing
the command prints can be taken for the answer.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import re
import secrets
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Answer",
    "ExecAnswer",
    "ProtocolError",
    "exec_script",
    "init_script",
    "new_tag",
    "parse_answer",
    "parse_exec",
    "read_script",
    "stream_script",
    "resolve_path",
    "stage_script",
    "write_script",
]

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: where runuser may be (launched by absolute path only: it runs with root's authority)
RUNUSER_PATHS = ("/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser", "/bin/runuser")


class ProtocolError(RuntimeError):
    """The answer of a sandbox script could not be read (the target printed something else)."""


def new_tag() -> str:
    return "HERMES-INSPECT-" + secrets.token_hex(8)


def resolve_path(workdir: str, path: str) -> str:
    """``path`` as the target sees it: relative paths are under the sample's working directory."""
    if not path:
        raise ValueError("an empty path names no file")
    if "\0" in path:
        raise ValueError(f"a path cannot contain NUL: {path!r}")
    return path if path.startswith("/") else posixpath.join(workdir, path)


def _q(text: str) -> str:
    return shlex.quote(text)


def init_script(tag: str, *, make_workdir: bool) -> str:
    """Make the sample's private control directory (and working directory); answer with both and the start cwd."""
    work = '__hi_w=$(command mktemp -d "${TMPDIR:-/tmp}/hermes-inspect-work.XXXXXX") || exit 1' if make_workdir else "__hi_w=-"
    return (
        "(\n"
        '__hi_c=$(command mktemp -d "${TMPDIR:-/tmp}/hermes-inspect.XXXXXX") || exit 1\n'
        f"{work}\n"
        f"printf '%s %s %s %s\\n' {tag} \"$__hi_c\" \"$__hi_w\" \"$(pwd)\"\n"
        ")"
    )


def stage_script(dest: str, *, append: bool) -> str:
    """Decode the base64 on stdin into ``dest`` (a file in the control directory)."""
    return f"command base64 -d {'>>' if append else '>'} {_q(dest)}"


def _command_lines(
    argv: Sequence[str], *, cwd: str, env: Mapping[str, str] | None, user: str | None
) -> list[str]:
    """The inner subshell: enter ``cwd``, pick the user, export ``env``, exec ``argv``.

    When ``argv[0]`` is a path that cannot be executed, ``$__hi_d/x`` says
    ``exec 126``; when the user cannot be switched to, ``nouser WHY``.
    """
    if not argv:
        raise ValueError("exec needs a command: cmd is an empty list")
    command = shlex.join(argv)
    exports = []
    for key, value in (env or {}).items():
        if not ENV_NAME.match(key):
            raise ValueError(f"not an environment variable name: {key!r} (letters, digits and _, not first a digit)")
        exports.append(f"export {key}={_q(value)}")
    lines = ["(", f"cd -- {_q(cwd)} || exit 1"]
    if "/" in argv[0]:
        # A subshell exits when exec fails (execfail or not): say why first.
        p = _q(argv[0])
        lines.append(
            f"if [ -d {p} ] || {{ [ -e {p} ] && [ ! -x {p} ]; }}; then "
            f"printf 'exec 126' > \"$__hi_d/x\"; printf '%s: Permission denied\\n' {p} >&2; exit 126; fi"
        )
    if user is None:
        lines += exports + [f"exec -- {command}"]
    else:
        probes = " ".join(_q(p) for p in RUNUSER_PATHS)
        lines += [
            f"__hi_u={_q(user)}",
            'if [ "$__hi_u" = "$(command id -un)" ] || [ "$__hi_u" = "$(command id -u)" ]; then set --',
            "elif [ \"$(command id -u)\" != 0 ]; then printf 'nouser not-root' > \"$__hi_d/x\"; exit 1",
            "else",
            f'  __hi_r=; for __hi_p in {probes}; do [ -x "$__hi_p" ] && {{ __hi_r=$__hi_p; break; }}; done',
            "  [ -n \"$__hi_r\" ] || { printf 'nouser no-runuser' > \"$__hi_d/x\"; exit 1; }",
            '  set -- "$__hi_r" -u "$__hi_u" --',
            "fi",
            *exports,
            f'exec -- "$@" {command}',
        ]
    return lines


def _control_dir(ctl: str) -> str:
    return f"__hi_d=$(command mktemp -d {_q(ctl)}/x.XXXXXX) || exit 1"


_EXEC_KIND = '__hi_x=$(command cat "$__hi_d/x" 2>/dev/null) || __hi_x="- -"'


def exec_script(
    tag: str,
    ctl: str,
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str] | None,
    user: str | None,
    limit: int,
    stdin_file: str | None,
) -> str:
    """Run ``argv`` in ``cwd`` with ``env`` (as ``user``), stdout and stderr into files, then answer.

    The header is ``TAG rc out_bytes err_bytes kind detail``; kind is ``-``,
    ``exec`` (exec itself failed, detail its status) or ``nouser``. Then the
    last ``limit`` bytes of stdout and of stderr, base64, each ended by a
    ``.`` line.
    """
    lines = ["(", _control_dir(ctl)] + _command_lines(argv, cwd=cwd, env=env, user=user)
    lines += [
        ") " + (f"< {_q(stdin_file)} " if stdin_file else "") + '> "$__hi_d/o" 2> "$__hi_d/e"',
        "__hi_s=$?",
        _EXEC_KIND,
        f"printf '%s %s %s %s %s\\n' {tag} \"$__hi_s\" \"$(command wc -c < \"$__hi_d/o\")\" "
        '"$(command wc -c < "$__hi_d/e")" "$__hi_x"',
        f'command tail -c {int(limit)} "$__hi_d/o" | command base64; echo .',
        f'command tail -c {int(limit)} "$__hi_d/e" | command base64; echo .',
        'command rm -rf -- "$__hi_d"',
    ]
    if stdin_file:
        lines.append(f"command rm -f -- {_q(stdin_file)}")
    lines.append(")")
    return "\n".join(lines)


def stream_script(
    tag: str,
    ctl: str,
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str] | None,
    user: str | None,
    stdin_file: str | None,
) -> str:
    """Like ``exec_script`` but stdout flows live: first a ``TAG-started`` line, then the
    command's stdout, then (right after it) ``TAG rc err_bytes kind detail``, then stderr (base64, ``.``)."""
    lines = ["(", _control_dir(ctl), f"printf '%s-started\\n' {tag}"] + _command_lines(argv, cwd=cwd, env=env, user=user)
    lines += [
        ") " + (f"< {_q(stdin_file)} " if stdin_file else "") + '2> "$__hi_d/e"',
        "__hi_s=$?",
        _EXEC_KIND,
        f"printf '%s %s %s %s\\n' {tag} \"$__hi_s\" \"$(command wc -c < \"$__hi_d/e\")\" \"$__hi_x\"",
        'command base64 < "$__hi_d/e"; echo .',
        'command rm -rf -- "$__hi_d"',
    ]
    if stdin_file:
        lines.append(f"command rm -f -- {_q(stdin_file)}")
    lines.append(")")
    return "\n".join(lines)


def read_script(tag: str, path: str, *, limit: int) -> str:
    """Answer ``TAG isdir|noent|perm|limit N|ok N``, then (ok) the file base64 and a ``.`` line."""
    f = _q(path)
    return "\n".join(
        [
            "(",
            f"if [ -d {f} ]; then printf '%s isdir\\n' {tag}",
            f"elif [ ! -e {f} ]; then printf '%s noent\\n' {tag}",
            f"elif ! {{ : < {f}; }} 2>/dev/null; then printf '%s perm\\n' {tag}",
            f"else __hi_n=$(command wc -c < {f}); __hi_n=$((__hi_n))",
            f"  if [ \"$__hi_n\" -gt {int(limit)} ]; then printf '%s limit %s\\n' {tag} \"$__hi_n\"",
            f"  else printf '%s ok %s\\n' {tag} \"$__hi_n\"; command base64 < {f}; echo .; fi",
            "fi",
            ")",
        ]
    )


def write_script(tag: str, path: str, *, source: str | None) -> str:
    """Write stdin (or the staged ``source``) to ``path``, making its parent directories.

    Answer ``TAG ok``, ``TAG isdir``, or ``TAG mkdir|open|write`` followed by
    the shell's own message.
    """
    f = _q(path)
    src = f"command cat -- {_q(source)}" if source else "command cat"
    lines = [
        "(",
        f"if [ -d {f} ]; then printf '%s isdir\\n' {tag}; exit 0; fi",
        f'if ! __hi_m=$(command mkdir -p -- "$(command dirname -- {f})" 2>&1); then',
        f"  printf '%s mkdir %s\\n' {tag} \"$__hi_m\"; exit 0",
        "fi",
        f"if ! __hi_m=$( {{ : >> {f}; }} 2>&1 ); then printf '%s open %s\\n' {tag} \"$__hi_m\"; exit 0; fi",
        f"if __hi_m=$( {{ {src} > {f}; }} 2>&1 ); then printf '%s ok\\n' {tag}",
        f"else printf '%s write %s\\n' {tag} \"$__hi_m\"; fi",
    ]
    if source:
        lines.append(f"command rm -f -- {_q(source)}")
    lines.append(")")
    return "\n".join(lines)


@dataclass(frozen=True)
class Answer:
    """A script's header fields, and what followed the header line."""

    fields: tuple[str, ...]
    rest: str


def parse_answer(tag: str, output: str) -> Answer:
    at = output.rfind(tag + " ")
    if at < 0 or (at > 0 and output[at - 1] != "\n"):
        raise ProtocolError(f"no answer in the target's output: {output[-500:]!r}")
    end = output.find("\n", at)
    if end < 0:
        raise ProtocolError(f"the answer line is cut: {output[at:at + 500]!r}")
    return Answer(tuple(output[at + len(tag) + 1 : end].split(" ")), output[end + 1 :])


def decode_block(text: str) -> tuple[bytes, str]:
    """The base64 block at the start of ``text`` (ended by a ``.`` line), and what follows it."""
    end = text.find(".\n") if text.startswith(".\n") else text.find("\n.\n")
    if end < 0:
        raise ProtocolError("a base64 block has no end line (the output was cut)")
    body, rest = (text[:end], text[end + 2 :]) if text.startswith(".\n") else (text[:end], text[end + 3 :])
    try:
        return base64.b64decode("".join(body.split()), validate=True), rest
    except binascii.Error as exc:
        raise ProtocolError(f"a base64 block does not decode: {exc}") from None


@dataclass(frozen=True)
class ExecAnswer:
    returncode: int
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    kind: str
    detail: str


def parse_exec(tag: str, output: str) -> ExecAnswer:
    answer = parse_answer(tag, output)
    if len(answer.fields) < 5:
        raise ProtocolError(f"short exec answer: {answer.fields!r}")
    try:
        rc, out_n, err_n = int(answer.fields[0]), int(answer.fields[1]), int(answer.fields[2])
    except ValueError:
        raise ProtocolError(f"bad exec answer: {answer.fields!r}") from None
    out, rest = decode_block(answer.rest)
    err, _ = decode_block(rest)
    return ExecAnswer(rc, out, err, out_n, err_n, answer.fields[3], " ".join(answer.fields[4:]))
