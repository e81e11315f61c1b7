"""The bash text of the wrapper: what runs before, around and after a command.

Only text is built here; ``session.py`` decides what goes in it. The script
reaches bash through a private channel (stdin or a 0600 file, never a command
line) and is one physical line, so the command inside is numbered as in a plain
``bash -c`` ("bash: line 1: ...").
"""

from __future__ import annotations

import re
import secrets
import shlex

__all__ = [
    "OUT_FD",
    "ansi_c_quote",
    "capture_line",
    "cd_line",
    "epilogue",
    "exit_trap",
    "one_line",
    "quote_dir",
    "ret_function",
    "stdin_statement",
    "stub",
]

#: The wrapper's copy of the command's stdout, high enough that a command
#: closing its descriptors (``for fd in {3..40}; do exec {fd}>&-; done``) keeps it.
OUT_FD = 63

# The state sections the save writes, in order; the parser reads them back.
SECTIONS = ("vars", "funcs", "aliases", "opts", "full", "traps", "soft", "hard", "hash", "jobs", "times", "left")


def stub(channel: str, path: str | None = None) -> str:
    """The constant ``bash -c`` argument that reads the private script and runs it.

    Nothing secret is in it: the script comes from stdin, or from a 0600 file in
    the private state directory that the script empties before the command runs.
    """
    if channel == "file":
        assert path is not None
        return f'__hermes_c=$(<{shlex.quote(path)}); builtin eval "$__hermes_c"'
    return '__hermes_c=$(</dev/stdin); builtin eval "$__hermes_c"'


# Sourced through BASH_ENV by the bash that reads a command as its script
# (``script_stub``): reads the private prelude, of exact length, from stdin.
LOADER = (
    "builtin unset -v BASH_ENV; IFS= builtin read -r __hermes_n; "
    'LC_ALL=C IFS= builtin read -r -N "$__hermes_n" __hermes_c; builtin unset -v __hermes_n; '
    'builtin eval "$__hermes_c"\n'
)


def script_stub(private_dir: str, *, login: bool, from_file: str | None = None, inline: str | None = None) -> str:
    """The ``bash -c`` argument for a command that bash reads as its own script,
    so that xtrace and messages are exactly a plain bash's.

    It refreshes the constant loader in the private directory (refusing one that
    is not a directory of ours) and becomes ``bash bash`` there: ``./bash`` is a
    link to its stdin (or to the private file), which bash reads through a
    close-on-exec descriptor of its own, named "bash" in its messages.
    """
    q = shlex.quote(private_dir)
    read = redirect = ""
    if inline is not None:
        # For a backend that delivers the whole script privately itself.
        read = f"__hermes_c={ansi_c_quote(inline)} && "
        redirect = ' < <(builtin printf \'%s\' "$__hermes_c")'
    elif from_file:
        # A file reopened through /dev/stdin would start again at offset 0:
        # its text goes through a pipe, and the file is emptied first.
        f = shlex.quote(from_file)
        read = f"__hermes_c=$(<{f}) && builtin : >|{f} && "
        redirect = ' < <(builtin printf \'%s\' "$__hermes_c")'
    # No ln in the target (a minimal image): the same script, evaluated here
    # (xtrace then shows one more "+", messages count lines from the prelude).
    fallback = (
        'IFS= builtin read -r __hermes_n && LC_ALL=C IFS= builtin read -r -N "$__hermes_n" __hermes_c && '
        '__hermes_u=$(</dev/stdin) && builtin eval "$__hermes_c"$\'\\n\'"$__hermes_u"'
    )
    return (
        f"[ -e {q} ] || (builtin umask 077; command mkdir -m 700 -- {q}) 2>/dev/null; "
        f"if {read}[ -d {q} ] && [ -O {q} ] && [ ! -L {q} ] && builtin cd -P -- {q}; then "
        f"if builtin umask 077 && builtin printf '%s' {shlex.quote(LOADER)} >|env && "
        f"{{ [ -L bash ] || command ln -s /dev/stdin bash; }} 2>/dev/null; then "
        f"SHLVL=$((SHLVL - 1)) BASH_ENV={q}/env builtin exec bash{' -l' if login else ''} bash{redirect}; fi; "
        f"{{ {fallback}; }}{redirect}; builtin exit; fi; "
        f"builtin printf 'hermes-env: private state directory %s is not usable\\n' {q} >&2; builtin exit 125"
    )


def ansi_c_quote(text: str) -> str:
    """Quote ``text`` as one bash ``$'...'`` word with no raw newline in it."""
    return "$'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


#: One quoted word as ``declare -p`` prints values: "..." or $'...'.
DECLARED_WORD = re.compile(r'"((?:[^"\\]|\\.)*)"|\$\'((?:[^\'\\]|\\.)*)\'', re.S)
_C_ESCAPES = {"a": 7, "b": 8, "e": 27, "E": 27, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}
_C_ESCAPE = re.compile(r"\\(?:([0-7]{1,3})|x([0-9A-Fa-f]{1,2})|u([0-9A-Fa-f]{1,4})|U([0-9A-Fa-f]{1,8})|c(.)|(.))", re.S)


def declared_value(m: re.Match[str]) -> str:
    """The text of a ``DECLARED_WORD`` match (bytes that are not UTF-8 as surrogate escapes)."""
    if m.group(1) is not None:
        return re.sub(r'\\(["$`\\])', r"\1", m.group(1))
    out = bytearray()
    body = m.group(2)
    pos = 0
    for e in _C_ESCAPE.finditer(body):
        out += body[pos : e.start()].encode("utf-8", "surrogateescape")
        octal, hexa, u4, u8, ctl, other = e.groups()
        if octal is not None:
            out.append(int(octal, 8) & 0xFF)
        elif hexa is not None:
            out.append(int(hexa, 16))
        elif u4 is not None or u8 is not None:
            out += chr(int(u4 or u8, 16)).encode("utf-8", "surrogatepass")
        elif ctl is not None:
            out.append(ord(ctl) & 0x1F)
        else:
            out += _C_ESCAPES[other].to_bytes(1, "big") if other in _C_ESCAPES else other.encode("utf-8", "surrogateescape")
        pos = e.end()
    out += body[pos:].encode("utf-8", "surrogateescape")
    return out.decode("utf-8", "surrogateescape")


def one_line(parts: list[str]) -> str:
    """Join statements into one physical line; text spanning lines goes through eval."""
    return "; ".join(p if "\n" not in p else "builtin eval " + ansi_c_quote(p) for p in parts)


def quote_dir(path: str) -> str:
    """Quote a directory for ``cd``, expanding a leading ``~`` to the target's $HOME."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _frame_printf(nonce: str, body: str) -> str:
    """printf of a frame to the wrapper's stdout copy, or to stdout if the command closed it."""
    return (
        f"{{ builtin printf {body} >&{OUT_FD}; }} 2>/dev/null || "
        f"{{ builtin printf {body}; }} 2>/dev/null"
    )


def cd_line(path: str, nonce: str | None) -> str:
    """Enter ``path``; if it cannot be entered, say so, report a stateless frame, exit 126."""
    q = quote_dir(path)
    frame = ""
    if nonce is not None:
        frame = _frame_printf(nonce, f"'\\036{nonce}:S126 0 0 3\\037\\036{nonce}:E\\n'") + "; "
    return (
        f"builtin cd -- {q} 2>/dev/null || {{ "
        f"builtin printf 'hermes-env: cannot enter working directory: %s\\n' {q}; {frame}builtin exit 126; }}"
    )


def ret_function(status: int, late: str, first: str = "") -> str:
    """``__hermes_ret``: sets ``$?`` (and ``$_`` from its argument) for the command,
    then, from a RETURN trap that removes itself, applies ``late`` (traps and
    ``set`` options that would otherwise fire on, or trace, the wrapper).
    ``first``: statements it runs before (the command's stdin, in script mode)."""
    body = "builtin trap - RETURN" + (f"; {late}" if late else "")
    return (
        "__hermes_ret() { builtin unset -f __hermes_ret; " + (f"{first}\n" if first else "")
        + f"builtin trap -- {shlex.quote(body)} RETURN; builtin return {int(status)}; }}"
    )


def capture_line() -> str:
    """Appended after the command inside its eval: keeps ``$?``, ``$_`` and the
    options before anything of ours runs (its own trace goes to /dev/null)."""
    return "{ __hermes_r=$? __hermes_l=$_ __hermes_so=$SHELLOPTS; builtin set +eux; } 2>/dev/null"


_SAVE = r"""__hermes_save() {
builtin unset -f __hermes_save
builtin trap - DEBUG ERR RETURN
builtin local __hermes_x=$1 __hermes_s= __hermes_k= __hermes_fds= __hermes_new= __hermes_e=0 __hermes_w=$PWD
builtin local __hermes_d=%(dir)s __hermes_f=%(file)s __hermes_sep=%(sep)s
[ "$__hermes_x" = exit ] && builtin trap - EXIT
__hermes_dump() {
builtin declare -p; builtin declare -p DIRSTACK; builtin printf '%%s\n' "$__hermes_sep"
builtin declare -f; builtin printf '%%s\n' "$__hermes_sep"
builtin alias -p; builtin printf '%%s\n' "$__hermes_sep"
builtin umask -p; builtin printf '%%s\n%%s\n' "$__hermes_so" "$__hermes_sep"
if [ -n "$__hermes_full" ]; then builtin set +o; builtin shopt -p; fi; builtin printf '%%s\n' "$__hermes_sep"
builtin trap -p; builtin printf '%%s\n' "$__hermes_sep"
builtin ulimit -S -a; builtin printf '%%s\n' "$__hermes_sep"
builtin ulimit -H -a; builtin printf '%%s\n' "$__hermes_sep"
builtin hash -l 2>/dev/null; builtin printf '%%s\n' "$__hermes_sep"
builtin jobs -p; builtin printf '%%s\n' "$__hermes_sep"
builtin printf '%%s %%s\n' "$$" "$BASHPID"; builtin times; builtin printf '%%s\n' "$__hermes_sep"
}
if [ ! -e "$__hermes_d" ] && [ ! -L "$__hermes_d" ]; then
  (builtin umask 077; command mkdir -m 700 -- "$__hermes_d") 2>/dev/null && __hermes_new=recreated
fi
[ -e "$__hermes_f" ] || [ -L "$__hermes_f" ] || (builtin umask 077; : >|"$__hermes_f") 2>/dev/null
# Only a regular file of ours: never through a symlink, never into a FIFO.
if [ -d "$__hermes_d" ] && [ -O "$__hermes_d" ] && [ ! -L "$__hermes_d" ] && [ -f "$__hermes_f" ] && [ ! -L "$__hermes_f" ] \
  && { __hermes_dump >|"$__hermes_f"; } 2>/dev/null; then
  IFS= builtin read -r -d '' __hermes_s <"$__hermes_f"
else
  __hermes_s=$(__hermes_dump 2>/dev/null; builtin printf x); __hermes_s=${__hermes_s%%x}
fi
builtin unset -f __hermes_dump
builtin trap - EXIT
builtin set +f
builtin shopt -u failglob nullglob nocaseglob 2>/dev/null
for __hermes_k in /proc/$$/fd/*; do
  __hermes_k=${__hermes_k##*/}
  case $__hermes_k in 0|1|2|255|%(fd)d|*[!0-9]*) ;; *) [ -e "/proc/$$/fd/$__hermes_k" ] && __hermes_fds+=" $__hermes_k";; esac
done
__hermes_s+="fds$__hermes_fds"$'\n'"$__hermes_new"$'\n'"$__hermes_sep"$'\n'
builtin local LC_ALL=C 2>/dev/null
if [[ $__hermes_s != *$'\037'* ]]; then __hermes_s=${__hermes_s//$'\n'/$'\037'}; __hermes_e=1; fi
%(printf)s
}"""


def save_function(*, nonce: str, sep: str, state_dir: str, state_file: str) -> str:
    """The save function, defined only once the command is over (its name is never visible to it)."""
    body = (
        f"'\\036%s:S%d %d %d %d\\037%s%s\\036%s:E\\n' {nonce} \"$__hermes_r\" \"${{#__hermes_w}}\" "
        f"\"${{#__hermes_s}}\" \"$__hermes_e\" \"$__hermes_w\" \"$__hermes_s\" {nonce}"
    )
    return _SAVE % {
        "dir": shlex.quote(state_dir),
        "file": shlex.quote(state_file),
        "sep": shlex.quote(sep),
        "fd": OUT_FD,
        "printf": _frame_printf(nonce, body),
    }


def epilogue(save_fn: str) -> str:
    """Runs after the command's eval returns: settle ``$?``, ``$_`` and options, then save."""
    return (
        "{ __hermes_e=$? __hermes_o=$SHELLOPTS; builtin set +eux; } 2>/dev/null; "
        "[[ -v __hermes_r ]] || __hermes_r=$__hermes_e; "
        # The command's first line did not parse: its late settings were never applied.
        "if builtin declare -F __hermes_ret >/dev/null 2>&1; then "
        "{ __hermes_ret ''; __hermes_so=$SHELLOPTS; builtin set +eux; } 2>/dev/null; fi; "
        "[[ -v __hermes_so ]] || __hermes_so=$__hermes_o; "
        "[[ -v __hermes_l ]] || __hermes_l=; "
        + one_line([save_fn])
        + "; __hermes_save end; builtin exit \"$__hermes_r\""  # the process status is the command's too
    )


def exit_trap(save_fn: str, user_body: str | None) -> str:
    """The EXIT trap that saves the state when a command calls ``exit`` (runs the
    user's own EXIT trap first, once)."""
    parts = ["{ __hermes_r=$? __hermes_l=$_ __hermes_so=$SHELLOPTS; } 2>/dev/null"]
    if user_body:
        parts.append("builtin eval " + ansi_c_quote(user_body))
    parts.append("{ builtin set +eux; } 2>/dev/null")
    parts.append(one_line([save_fn]))
    parts.append("__hermes_save exit")
    return "builtin trap -- " + shlex.quote("; ".join(parts)) + " EXIT"


_UNSAFE_IN_HEREDOC = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def stdin_statement(data: bytes) -> str:
    """Statement that makes ``data`` the shell's stdin, through a heredoc whose delimiter is not in it."""
    try:
        text: str | None = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if not data:
        return "exec 0</dev/null"
    # bash mangles its internal quoting bytes (\001, \177) and cannot hold NUL:
    # such data travels base64-encoded.
    if text is None or _UNSAFE_IN_HEREDOC.search(text):
        import base64

        body = base64.encodebytes(data).decode("ascii")
        delim = _delimiter(body)
        return f"exec 0< <(command base64 -d <<'{delim}'\n{body}{delim}\n)"
    delim = _delimiter(text)
    if text.endswith("\n"):
        return f"exec 0<<'{delim}'\n{text}{delim}\n"
    # A heredoc always ends in a newline; strip the one we had to add.
    return (
        f"exec 0< <(IFS= builtin read -r -d '' __hermes_in <<'{delim}'\n{text}\n{delim}\n"
        f"builtin printf '%s' \"${{__hermes_in%$'\\n'}}\")"
    )


def _delimiter(text: str) -> str:
    lines = set(text.split("\n"))
    while True:
        delim = "HERMES_EOF_" + secrets.token_hex(8)
        if delim not in lines:
            return delim
