"""The session server: one bash in the target whose own shell state is the session.

The core opens one byte stream to a bash in the target (``BOOT_ARGV``) and
makes it read its script from that stream, as ``bash -s`` reads a terminal's
lines: every command is parsed and run at the server's top level, so
variables, functions, aliases, options, traps, limits, the directory stack,
``$?``, ``$_``, the job table and ``exec`` descriptors stay, with no restore
and no dump. Around each command the client sends two short lines of its own
(their traces and messages go to /dev/null) and reads back a report framed
by a per-command secret nonce.

Wire format, client to server (one write per command; bash reads a pipe one
byte at a time, so it never reads past what it parses):

    L1   read the command's first copy (N1 bytes) and check its syntax
    C1   the command (N1 bytes)
    L2   if it parses: stdin, cd, the start mark, then ``$?``/``$_`` of the
         previous command; else print bash's message, report 2 and skip the rest
    C2   the command again, then a newline: bash runs it at top level
    L3   the report: ``\\x1e NONCE :X rc \\0 PWD \\0 times \\0 \\n``

A command that never reaches L3 (``exit``, ``set -e``, a signal, a timeout)
ends the server; the client then starts a new one from the checkpoint, the
state it last read back while the session was idle.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import secrets
import shlex
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import BackendError, EnvironmentUnavailable
from .channel import ChannelStream
from .shellscript import SECTIONS, quote_dir, stdin_statement

__all__ = ["BOOT_ARGV", "ServerLost", "ServerReport", "SessionServer"]

_log = logging.getLogger(__name__)

#: What a target starts for a session server: a bash that reads one line (the
#: private directory, never on a command line), makes it, and becomes the
#: server, reading its script from the stream as ``./bash`` so that messages
#: read "bash: line N:".
BOOT_ARGV: tuple[str, ...] = (
    "bash",
    "-c",
    'IFS= read -r __d && IFS= read -r __l || exit 1; __s=$PWD; '
    '[ -e "$__d" ] || (umask 077; mkdir -m 700 -- "$__d") 2>/dev/null; '
    'if [ -d "$__d" ] && [ -O "$__d" ] && [ ! -L "$__d" ] && cd -P -- "$__d"; then '
    '{ [ -L bash ] || command ln -s /dev/fd/3 bash; } 2>/dev/null; [ -L bash ] && __b=bash || __b=/dev/fd/3; '
    'if [ -n "$__l" ]; then bash -l -c : </dev/null >/dev/null 2>&1 || { printf "\\036login-failed %d\\n" $?; __l=; }; fi; '
    '__hermes_start=$__s exec bash $__l "$__b" 3<&0 0</dev/null 2>&1; fi; '
    'printf "\\036private state directory %s is not usable\\n" "$__d"; exit 125',
)

_MARK = b"\x1e"
_HELLO_TIMEOUT_S = 60.0
_QUEUED_CHUNKS = 64  # read-ahead of at most 64 chunks of 64 KiB
_KILL_GRACE_CAP_S = 10.0


class ServerLost(BackendError):
    """The server ended or its stream broke (a command called ``exit``, was killed, or the target went away)."""


@dataclass(frozen=True)
class ServerReport:
    """What the server said about one finished command."""

    exit_code: int
    cwd: str
    cpu_times: tuple[float, float] | None  # cumulative (user, system) of the server and its children
    flags: str = ""  # ``$-`` after the command
    dir_recreated: bool = False  # the command removed the private directory; the server made it again


_TIME_RE = re.compile(rb"(\d+)m([\d.]+)s")


def _parse_times(text: bytes) -> tuple[float, float] | None:
    vals = [int(m) * 60 + float(s) for m, s in _TIME_RE.findall(text)]
    if len(vals) != 4:
        return None
    return vals[0] + vals[2], vals[1] + vals[3]


# The per-command lines. {n1}/{n2} are byte counts, {nonce} the report's secret.
_L1 = (
    "{ IFS= builtin read -r -d '' -u 255 __hermes_c; __hermes_ok=1; "
    'builtin eval "__hermes_k() { :;$__hermes_c"$\'\\n}\' || { __hermes_ok=; builtin eval :; }; '
    "builtin unset -f __hermes_k; } 2>/dev/null\n"
)
# The one-off working directory cannot be entered: say so, skip the command, report 126.
_CWD_FAIL = (
    "elif __hermes_ow=$PWD __hermes_oo=${{OLDPWD-}}; ! builtin cd -- {q} 2>/dev/null; then builtin printf '\\036{nonce}:S\\n'; "
    "builtin printf 'hermes-env: cannot enter working directory: %s\\n' {q}; "
    "while IFS= builtin read -r -u 255 __hermes_c && [[ $__hermes_c != '#{nonce}' ]]; do :; done; "
    "__hermes_r=126 __hermes_l=; builtin unset -v __hermes_ow __hermes_oo; "
    "builtin printf '\\036{nonce}:X%d\\0%s\\0' 126 \"$PWD\"; builtin times; builtin printf '\\0%s\\0\\n' \"$-\"; "
)
# On a syntax error: bash's own message, as ``bash -c`` words it.
_SYNTAX = (
    "__hermes_n=$LINENO; "
    '(builtin umask 077; builtin eval "__hermes_k() {{ :;$__hermes_c"$\'\\n}}\' 2>|{errf}); '
    "builtin printf '\\036{nonce}:S\\n'; "
    "__hermes_re='^bash: eval: line ([0-9]+): (.*)$'; while IFS= builtin read -r __hermes_c; do "
    "if [[ $__hermes_c =~ $__hermes_re ]]; then "
    "__hermes_c=${{BASH_REMATCH[2]}}; "
    "builtin printf 'bash: -c: line %d: %s\\n' $((BASH_REMATCH[1] - __hermes_n + 1)) \"${{__hermes_c/#\\`__hermes_k() {{ :;/\\`}}\"; "
    "else builtin printf '%s\\n' \"$__hermes_c\"; fi; done <{errf}; "
    "while IFS= builtin read -r -u 255 __hermes_c && [[ $__hermes_c != '#{nonce}' ]]; do :; done; "
    "__hermes_r=2 __hermes_l=; builtin unset -v __hermes_n __hermes_re; "
    "builtin printf '\\036{nonce}:X%d\\0%s\\0' 2 \"$PWD\"; builtin times; builtin printf '\\0%s\\0\\n' \"$-\"; "
)
_L2 = (
    "{{ if [[ -z $__hermes_ok ]]; then {syntax}{cwdfail}else {pre}"
    "IFS=' ' builtin read -r __hermes_c __hermes_c __hermes_c __hermes_c __hermes_c </proc/loadavg; "
    "builtin printf '\\036{nonce}:S%s\\n' \"$__hermes_c\"; fi; "
    "builtin unset -v __hermes_c __hermes_ok; "
    "__hermes_t() {{ builtin unset -f __hermes_t; builtin unset -v __hermes_r __hermes_l; return $1; }}; "
    'if ((__hermes_r)); then __hermes_t "$__hermes_r" "$__hermes_l" && :; '
    'else __hermes_t 0 "$__hermes_l"; fi; }} 2>/dev/null\n'
)
_L3 = (
    "{{ __hermes_r=$? __hermes_l=$_; {post}[[ -d {dir} ]] || {{ (builtin umask 077; command mkdir -m 700 -- {dir}); "
    "__hermes_r+=' r'; }}; builtin printf '\\036{nonce}:X%s\\0%s\\0' \"$__hermes_r\" \"$PWD\"; "
    "__hermes_r=${{__hermes_r% r}}; builtin times; builtin printf '\\0%s\\0\\n' \"$-\"; }} 2>/dev/null\n"
)

# The checkpoint: the sections ``session.parse_state_dump`` reads, between marks.
_DUMP = (
    "{{ __hermes_w=$PWD __hermes_so=$SHELLOPTS; builtin printf '\\036{nonce}:C'; "
    "builtin declare -p; builtin declare -p DIRSTACK; builtin printf '%s\\n' {sep}; "
    "builtin declare -f; builtin printf '%s\\n' {sep}; builtin alias -p; builtin printf '%s\\n' {sep}; "
    "builtin umask -p; builtin printf '%s\\n%s\\n' \"$__hermes_so\" {sep}; "
    "builtin set +o; builtin shopt -p; builtin printf '%s\\n' {sep}; "
    "builtin trap -p; builtin printf '%s\\n' {sep}; builtin ulimit -S -a; builtin printf '%s\\n' {sep}; "
    "builtin ulimit -H -a; builtin printf '%s\\n' {sep}; builtin hash -l; builtin printf '%s\\n' {sep}; "
    "builtin jobs -p; builtin printf '%s\\n' {sep}; builtin printf '%s %s\\n' $$ $$; builtin times; "
    "builtin printf '%s\\n' {sep}; builtin printf 'fds\\n\\n%s\\n' {sep}; "
    "builtin printf '\\036{nonce}:W%s\\0\\036{nonce}:E\\n' \"$__hermes_w\"; "
    "builtin unset -v __hermes_w __hermes_so; }} 2>/dev/null\n"
)
assert len(SECTIONS) == 12  # the dump above writes these twelve, in order


def _dump_text(nonce: str, letter: str = "C") -> str:
    text = _DUMP.format(nonce=nonce, sep=shlex.quote(f"#hermes-state:{nonce}"))
    return text if letter == "C" else text.replace(f"{nonce}:C", f"{nonce}:{letter}", 1)


# For a command that may end the server (exit, exec, set -e): an EXIT trap that
# runs the user's own EXIT trap, reports, and hands the state back. {ut} is the
# user's trap as ``trap -p EXIT`` printed it (read just before).
_EXIT_TRAP = (
    "__hermes_r=$? __hermes_l=$_; builtin trap - EXIT; "
    'if [[ -n $__hermes_xt ]]; then __hermes_xb=${{__hermes_xt#trap -- }}; builtin eval "__hermes_xb=${{__hermes_xb% EXIT}}"; '
    'builtin unset -v __hermes_xt; builtin eval "$__hermes_xb"; fi; builtin unset -v __hermes_xt __hermes_xb; '
    "{{ {dump}; }} 2>/dev/null; "
    "builtin printf '\\036{nonce}:X%d\\0%s\\0' \"$__hermes_r\" \"$PWD\"; builtin times; builtin printf '\\0%s\\0\\n' \"$-\""
)


def _safe_cut(buf: bytes, mark: bytes) -> int:
    """How much of ``buf`` is output for sure: all but a tail that may be the start of ``mark``."""
    i = buf.rfind(_MARK, max(len(buf) - len(mark) + 1, 0))
    while i >= 0:
        if mark.startswith(buf[i:]):
            return i
        i = buf.rfind(_MARK, max(len(buf) - len(mark) + 1, 0), i)
    return len(buf)


class SessionServer:
    """One session server over one stream. Not thread-safe: the environment
    runs one command at a time through it."""

    def __init__(
        self,
        opener: Callable[[Sequence[str]], ChannelStream],
        *,
        private_dir: str,
        login: bool,
        label: str,
        init: str = "",
    ) -> None:
        self._opener = opener
        self.private_dir = private_dir
        self.label = label
        # Bounded: a command that writes faster than the client consumes (``yes``) waits on
        # its pipe, as it would writing to a terminal, instead of filling this process's memory.
        self._chunks: queue.Queue[bytes] = queue.Queue(maxsize=_QUEUED_CHUNKS)
        self._closed = threading.Event()
        self._buf = b""
        self._stream = opener(BOOT_ARGV)
        self._dead = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name=f"{label}-server-reader", daemon=True)
        self._reader.start()
        self.pid = 0
        self.bash_version = ""
        self.dirty = True  # state changed since the last checkpoint
        #: the state a command that ended the server sent as it went (dump, separator, cwd)
        self.handover: tuple[str, str, str] | None = None
        #: the state sent back with the last report (``send_command(checkpoint=True)``)
        self.inline_checkpoint: tuple[str, str, str] | None = None
        try:
            self._boot(login, init)
        except BaseException:
            self.close()
            raise

    # -- the stream ------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                data = self._stream.read(1 << 16)
                if not data:
                    break
                if not self._queue(bytes(data)):
                    break
        except Exception as exc:  # noqa: BLE001 - a broken stream is a lost server
            _log.debug("%s: stream read failed: %r", self.label, exc)
        finally:
            self._dead.set()
            self._queue(b"")

    def _queue(self, data: bytes) -> bool:
        """Hand ``data`` to the client, waiting while the queue is full; False once closed."""
        while not self._closed.is_set():
            try:
                self._chunks.put(data, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _send(self, data: bytes) -> None:
        try:
            self._stream.write(data)
        except (OSError, ValueError, BackendError, EOFError) as exc:
            self._dead.set()
            raise ServerLost(f"{self.label}: the session server's stream broke ({exc})") from exc

    def _next(self, timeout: float | None) -> bytes | None:
        """The next chunk; None when ``timeout`` passed; raises ServerLost at the end of the stream."""
        try:
            data = self._chunks.get(timeout=timeout) if timeout is None or timeout > 0 else self._chunks.get_nowait()
        except queue.Empty:
            return None
        if not data:
            with contextlib.suppress(queue.Full):
                self._chunks.put_nowait(b"")  # keep saying so
            raise ServerLost(f"{self.label}: the session server ended")
        return data

    @property
    def alive(self) -> bool:
        return not self._dead.is_set() and self.handover is None

    def _read_until(self, mark: bytes, deadline: float, sink: Callable[[bytes], None] | None) -> None:
        """Feed bytes before ``mark`` to ``sink`` (None: drop them); keep what follows in the buffer."""
        while True:
            i = self._buf.find(mark)
            if i >= 0:
                if sink is not None and i:
                    sink(self._buf[:i])
                self._buf = self._buf[i + len(mark):]
                return
            keep = len(mark) - 1
            if len(self._buf) > keep:
                cut = len(self._buf) - keep
                if sink is not None:
                    sink(self._buf[:cut])
                self._buf = self._buf[cut:]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.label}: no answer from the session server")
            data = self._next(left)
            if data is not None:
                self._buf += data

    def _take_fields(self, count: int, deadline: float) -> list[bytes]:
        """``count`` NUL-terminated fields from the buffer."""
        while self._buf.count(b"\0") < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.label}: the session server's report was cut short")
            data = self._next(left)
            if data is not None:
                self._buf += data
        parts = self._buf.split(b"\0", count)
        self._buf = parts[count]
        return parts[:count]

    # -- boot ------------------------------------------------------------------
    def _boot(self, login: bool, init: str) -> None:
        nonce = secrets.token_hex(12)
        head = f"{self.private_dir}\n{'-l' if login else ''}\n".encode()
        init_text = (
            "{ exec 3<&-; (builtin umask 077; : >|in); builtin cd -- \"$__hermes_start\" 2>/dev/null; builtin export -n __hermes_start; "
            "builtin unset -v __hermes_start OLDPWD; builtin shopt -s expand_aliases; "
            "[[ -r /proc/$$/fd/255 ]] && command -v head >/dev/null && __hermes_h=head || __hermes_h=-; "
            "IFS= read -r __hermes_st </proc/$$/stat; __hermes_st=${__hermes_st##*) }; "
            f"builtin printf '\\036{nonce}:H%s %s %s %s\\n' \"$$\" \"$__hermes_h\" \"${{__hermes_st}}\" \"$BASH_VERSION\"; "
            "builtin unset -v __hermes_h __hermes_st; } 2>/dev/null\n"
            + (f"{{ {init}\n}} >/dev/null 2>&1\n" if init.strip() else "")
            + "{ __hermes_r=0 __hermes_l=; } 2>/dev/null\n"
        )
        self._send(head + init_text.encode())
        deadline = time.monotonic() + _HELLO_TIMEOUT_S
        noise: list[bytes] = []
        try:
            self._read_until(_MARK + nonce.encode() + b":H", deadline, noise.append)
        except ServerLost:
            said = b"".join(noise).decode(errors="replace").strip()
            raise EnvironmentUnavailable(
                f"{self.label}: bash in the target did not start the session server"
                + (f": {said[-300:]}" if said else " (the target needs bash on its PATH)")
            ) from None
        while b"\n" not in self._buf:
            data = self._next(max(deadline - time.monotonic(), 0.01))
            if data is not None:
                self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        m = re.search(rb"\x1elogin-failed (\d+)", b"".join(noise))
        self.login_failed = int(m.group(1)) if m else None
        pid, _, rest = line.decode(errors="replace").partition(" ")
        tool, _, rest = rest.partition(" ")
        fields = rest.split(" ")
        # /proc/PID/stat after the name: field 20 is the start time (ticks since boot), then the version.
        self.start_ticks = int(fields[19]) if len(fields) > 20 and fields[19].isdigit() else 0
        version = " ".join(fields[50:]) if len(fields) > 50 else (fields[-1] if fields else "")
        self.pid = int(pid) if pid.isdigit() else 0
        self.has_head = tool == "head"
        self.bash_version = version

    # -- commands --------------------------------------------------------------
    def send_command(
        self,
        command: str,
        *,
        cwd: str | None,
        stdin: bytes | None,
        may_exit: bool = False,
        checkpoint: bool = False,
    ) -> str:
        """Send one command; returns its nonce (read the output with ``read_output``).

        ``may_exit``: the command may end the server (``exit``, ``exec``,
        errexit): it then gets an EXIT trap that hands its state back.
        """
        nonce = secrets.token_hex(12)
        body = command.encode("utf-8", "surrogateescape")
        pre: list[str] = []
        post: list[str] = []
        if may_exit:
            trap = _EXIT_TRAP.format(nonce=nonce, dump=_dump_text(nonce).rstrip("\n"))
            pre.append(f"__hermes_xt=$(builtin trap -p EXIT); builtin trap -- {shlex.quote(trap)} EXIT")
            post.append(
                f'if [[ $(builtin trap -p EXIT) == *{nonce}* ]]; then '
                'if [[ -n $__hermes_xt ]]; then builtin eval "$__hermes_xt"; else builtin trap - EXIT; fi; fi; '
                "builtin unset -v __hermes_xt"
            )
        data = b""
        if stdin is not None and self.has_head and stdin:
            # The bytes follow this line in the stream; head reads exactly that many (bash
            # itself would read them one by one) into a private file the command reads.
            inf = shlex.quote(self.private_dir + "/in")
            # (bash refuses a redirection from its own script descriptor; the same pipe through /proc is fine)
            pre.append(f"command head -c {len(stdin)} </proc/$$/fd/255 >|{inf}; exec 0<{inf}")
            post.append(f"exec 0</dev/null; : >|{inf}")
            data = stdin
        elif stdin is not None:
            pre.append(stdin_statement(stdin))
            post.append("exec 0</dev/null")
        cwdfail = ""
        if cwd is not None:
            q = quote_dir(cwd)
            cwdfail = _CWD_FAIL.format(q=q, nonce=nonce)
            post.append(
                'builtin cd -- "$__hermes_ow"; OLDPWD=$__hermes_oo; builtin unset -v __hermes_ow __hermes_oo'
            )
        pre_text = "".join(p + "\n" if p.startswith("exec 0<<") or "\n" in p else p + "; " for p in pre)
        if checkpoint:
            # The state goes back with the report, in the same round trip (a command that changed it).
            post.append(_dump_text(nonce, "K").rstrip("\n"))
        l3 = _L3.format(nonce=nonce, post="".join(p + "; " for p in post), dir=shlex.quote(self.private_dir)).encode()
        c2 = body + b"\n"
        errf = shlex.quote(self.private_dir + "/err")
        syntax = _SYNTAX.format(nonce=nonce, errf=errf)
        l2 = _L2.format(nonce=nonce, syntax=syntax, pre=pre_text, cwdfail=cwdfail).encode("utf-8", "surrogateescape")
        # The first copy ends at a NUL (a command never holds one); after the report,
        # a comment line that a command skipped for its syntax error reads up to.
        self.dirty = True
        self._send(_L1.encode() + body + b"\0" + l2 + data + c2 + l3 + f"#{nonce}\n".encode())
        return nonce

    def wait_started(self, nonce: str, deadline: float) -> int:
        """Drop what comes before the command's start mark (late output of earlier background jobs).

        Returns the last process id the target had handed out as the command started (0: unknown):
        every process of the command has a higher one, until the ids wrap around.
        """
        self._read_until(_MARK + nonce.encode() + b":S", deadline, None)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.label}: the start mark was cut short")
            data = self._next(left)
            if data is not None:
                self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return int(line) if line.isdigit() else 0

    def read_output(
        self, nonce: str, sink: Callable[[bytes], None], *, poll_s: float, should_stop: Callable[[], bool]
    ) -> ServerReport | None:
        """Pass output to ``sink`` until the report; None when ``should_stop()`` became true first.

        A command that ends the server (``exit``) sends the state it reached
        first; it is kept as ``handover``.
        """
        report_mark = _MARK + nonce.encode() + b":X"
        dump_mark = _MARK + nonce.encode() + b":C"
        ck_mark = _MARK + nonce.encode() + b":K"
        while True:
            i = self._buf.find(report_mark)
            for mark in (dump_mark, ck_mark):
                j = self._buf.find(mark)
                if j >= 0 and (i < 0 or j < i):
                    if j:
                        sink(self._buf[:j])
                    self._buf = self._buf[j:]
                    got = self._read_dump(nonce, time.monotonic() + 30.0, mark[-1:])
                    if mark is dump_mark:
                        self.handover = got
                    else:
                        self.inline_checkpoint = got
                    break
            else:
                j = -1
            if j >= 0:
                continue
            if i >= 0:
                if i:
                    sink(self._buf[:i])
                self._buf = self._buf[i + len(report_mark):]
                deadline = time.monotonic() + 30.0
                rc, cwd, times, flags = self._take_fields(4, deadline)
                while not self._buf:  # the report's newline
                    data = self._next(min(5.0, max(deadline - time.monotonic(), 0.01)))
                    if data is None:
                        break
                    self._buf += data
                if self._buf.startswith(b"\n"):
                    self._buf = self._buf[1:]
                rc, _, extra = rc.partition(b" ")
                return ServerReport(
                    dir_recreated=extra == b"r",
                    exit_code=int(rc) if rc.isdigit() else 1,
                    cwd=cwd.decode("utf-8", "surrogateescape"),
                    cpu_times=_parse_times(times),
                    flags=flags.decode(errors="replace"),
                )
            cut = _safe_cut(self._buf, report_mark)
            if cut:
                sink(self._buf[:cut])
                self._buf = self._buf[cut:]
            if should_stop():
                if self._buf:
                    sink(self._buf)  # the command is being stopped: all of it is output
                    self._buf = b""
                return None
            data = self._next(poll_s)
            if data is not None:
                self._buf += data

    # -- checkpoint ------------------------------------------------------------
    def checkpoint(self, *, timeout: float = 30.0) -> tuple[str, str, str]:
        """Read the state back between commands: (dump text, separator, cwd)."""
        nonce = secrets.token_hex(12)
        self._send(_dump_text(nonce).encode())
        deadline = time.monotonic() + timeout
        self._read_until(_MARK + nonce.encode() + b":C", deadline, None)
        self._buf = _MARK + nonce.encode() + b":C" + self._buf
        got = self._read_dump(nonce, deadline)
        self.dirty = False
        return got

    def _read_dump(self, nonce: str, deadline: float, letter: bytes = b"C") -> tuple[str, str, str]:
        mark = _MARK + nonce.encode()
        self._read_until(mark + b":" + letter, deadline, None)
        parts: list[bytes] = []
        self._read_until(mark + b":W", deadline, parts.append)
        cwd = self._take_fields(1, deadline)[0]
        self._read_until(mark + b":E\n", deadline, None)
        return (
            b"".join(parts).decode("utf-8", "surrogateescape"),
            f"#hermes-state:{nonce}",
            cwd.decode("utf-8", "surrogateescape"),
        )

    # -- the end ---------------------------------------------------------------
    def quit(self, timeout: float = 10.0) -> bytes:
        """End the server as ``exit`` would (the user's EXIT trap runs); returns what it printed."""
        out: list[bytes] = []
        try:
            self._send(b"builtin exit 0\n")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                out.append(self._buf)
                self._buf = b""
                data = self._next(max(deadline - time.monotonic(), 0.01))
                if data is not None:
                    self._buf += data
        except ServerLost:
            pass
        except TimeoutError:
            pass
        finally:
            self.close()
        return b"".join(out)

    def close(self) -> None:
        self._closed.set()  # the reader thread stops waiting for room in the queue
        try:
            self._stream.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            _log.debug("%s: closing the stream failed", self.label, exc_info=True)
        # Output nobody will take goes; a read after this sees the end at once.
        with contextlib.suppress(queue.Empty):
            while True:
                self._chunks.get_nowait()
        with contextlib.suppress(queue.Full):
            self._chunks.put_nowait(b"")


# Signals every process of the command's tree: the server's descendants that
# started after the command did (earlier background jobs are left alone), read
# again before each round; with ``server`` the server itself too (it is
# stopped first, so that no further statement of the command runs).
KILL_PROGRAM = r"""
# Started during the command: a process id above the last one handed out when it
# began (else, the ids having wrapped, a start time well after it: ticks, 100 a second).
__k_new() {
  if ((last > 0)); then (( $1 > last || 10#$2 > 10#$now - since + 2 )); else (( 10#$2 >= 10#$now - since )); fi
}
__k_main() {
local pid=$1 sig=$2 since=$3 server=$4 last=${5:-0} pst=${6:-0} rounds=1 total=0 p s f up now cg mycg sid=
local -A kids seen pp sids anc
local -a todo all orph
[[ $sig == KILL ]] && rounds=20
IFS=' ' read -r up _ </proc/uptime
now=${up%.*}${up#*.}
# Only the server we started: the same process id with the same start time (a target
# started again reuses ids).
if ((pst)); then
  s=; IFS= read -r s 2>/dev/null <"/proc/$pid/stat"; s=${s##*) }; set -- $s
  [[ ${20} == "$pst" ]] || { printf 'killed 0
'; return 0; }
fi
IFS= read -r -d '' cg <"/proc/$pid/cgroup" 2>/dev/null
[[ -n $cg ]] && __k_cg=$cg
[[ -z $cg && -n ${__k_cg-} ]] && cg=$__k_cg  # the server is gone: the cgroup it had
# A cgroup of the whole host says nothing about who started a process.
[[ $cg == *$'\n0::/\n'* || $cg == $'0::/\n'* ]] && cg=
((server == 1 || server == 2)) && kill -STOP "$pid" 2>/dev/null
while ((rounds--)); do
  kids=() seen=() todo=() all=() pp=() sids=() anc=() orph=()
  for p in /proc/[0-9]*; do
    IFS= read -r s 2>/dev/null <"$p/stat" || continue
    s=${s##*) }
    set -- $s
    p=${p#/proc/}
    sids[$p]=$4  # a dead server's session still names its orphans
    [[ $1 == Z ]] && continue
    kids[$2]+=" $p:${20}"
    pp[$p]=$2
    __k_new "$p" "${20}" && orph+=("$p:${20}")
  done
  sid=${sids[$pid]}
  # The server's ancestors: where its orphans are re-parented (init, a subreaper).
  p=${pp[$pid]}
  while [[ -n $p && -z ${anc[$p]} ]]; do anc[$p]=1; p=${pp[$p]}; done
  anc[1]=1
  # An orphan of the command (a double fork, setsid): re-parented above the server,
  # started during the command, in the server's session or its own cgroup.
  for f in "${orph[@]}"; do
    p=${f%%:*}
    [[ -n ${anc[${pp[$p]}]} && $p != "$pid" ]] || continue
    if [[ ${sids[$p]} == "$sid" ]]; then todo+=("$f"); continue; fi
    [[ -n $cg ]] || continue
    mycg=; IFS= read -r -d '' mycg <"/proc/$p/cgroup" 2>/dev/null
    [[ $mycg == "$cg" ]] && todo+=("$f")
  done
  todo+=(${kids[$pid]})
  while ((${#todo[@]})); do
    f=${todo[0]}; todo=("${todo[@]:1}")
    p=${f%%:*}
    [[ -n ${seen[$p]} || $p == "$$" || $p == "$BASHPID" || $p == "$PPID" ]] && continue
    seen[$p]=1
    if __k_new "$p" "${f#*:}"; then all+=("$p"); todo+=(${kids[$p]}); fi
  done
  # 3: the server is the command's shell and gets the signal too (a TERM trap of the session runs).
  if ((server == 3)) && [[ ${sids[$pid]+x} ]]; then
    [[ $sig == 0 ]] && all+=("$pid")
  fi
  ((${#all[@]})) || { ((server == 3)) && [[ $sig != 0 ]] && kill "-$sig" "$pid" 2>/dev/null; break; }
  total=$((total + ${#all[@]}))
  [[ $sig == 0 ]] && break
  kill -STOP "${all[@]}" 2>/dev/null
  kill "-$sig" "${all[@]}" 2>/dev/null
  kill -CONT "${all[@]}" 2>/dev/null
  ((server == 3)) && kill "-$sig" "$pid" 2>/dev/null
done
((server == 2)) && kill -KILL "$pid" 2>/dev/null
printf 'killed %d\n' "$total"
}
"""


def kill_request(pid: int, sig: str, since_ticks: int, *, server: int) -> str:
    """The script for a second stream that signals a command's tree (see ``KILL_PROGRAM``)."""
    return f"{KILL_PROGRAM}__k_main {int(pid)} {shlex.quote(sig)} {int(since_ticks)} {int(server)}\n"
