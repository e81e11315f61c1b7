"""Conformance: one long-lived bash, for real, and a private state channel.

``DifferentialConformance`` runs a session's lines through ``execute()`` and
the same lines through ONE ``bash -s`` in the same target (printing its exit
status after each line), then compares the two transcripts line by line.
``LongLivedConformance`` checks what a reference bash cannot show (the EXIT
trap, messages numbered as ``bash -c``), ``PrivacyConformance`` what another
process must not see or forge.
"""

from __future__ import annotations

import difflib
import re
import secrets
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..environment.base import BaseEnvironment
from ..environment.session import CommandError

__all__ = ["DifferentialConformance", "LongLivedConformance", "PrivacyConformance", "differential_lines"]


def differential_lines(scratch: str) -> list[str]:
    """The session the differential test replays: every item a long-lived bash keeps."""
    f = shlex.quote(scratch)
    return [
        "cd /; cd /tmp",
        'cd - >/dev/null; pwd; echo "old=$OLDPWD"',
        "pushd /usr >/dev/null; pushd /etc >/dev/null; dirs",
        "dirs -v; popd >/dev/null; dirs",
        "popd; dirs; cd /tmp",
        "false",
        'echo "prev=$?"',
        "(exit 7)",
        'echo "prev=$?"; echo a b c',
        'echo "last=$_"',
        "X=1; export Y='two words'; arr=(one 'two words' $'new\\nline'); declare -A m=([k]=v); Z=gone",
        'unset Z; echo "$X|$Y|${arr[1]}|${#arr[@]}|${m[k]}|${Z-unset}"; declare -p arr',
        "f() { echo \"in f $1\"; }; alias hi='echo aliased'",
        "f x; hi; alias hi; declare -F f",
        "set -o pipefail; shopt -s extglob nullglob",
        "false | true; echo \"pf=$?\"; shopt -q extglob && echo extglob; set -o | grep -E '^(pipefail|noclobber) '",
        "shopt -u nullglob; umask 027",
        "umask; umask -S",
        "trap 'echo got-usr1' USR1; trap 'echo got-int' INT",
        "kill -USR1 $$; echo after-signal; trap -p",
        "trap - INT; trap -p",
        "ulimit -S -t 100000; ulimit -S -c 0",
        "ulimit -S -t; ulimit -S -c",
        "hash -p /bin/echo myecho",
        "myecho hashed; type myecho",
        f"set -C; rm -f {f}; echo one > {f}",
        f"echo two > {f}; echo \"rc=$?\"; cat {f}",
        f"set +C; echo three >| {f}; cat {f}; rm -f {f}",
        "readonly LC_ALL=C",
        'echo "lc=$LC_ALL"; readonly -p | grep -c LC_ALL',
        "for fd in {3..40}; do exec {fd}>&-; done; echo closed",
        'echo still-here "$X"',
        "compgen -v | grep -ci hermes; declare -F | grep -ci hermes; set | grep -ci hermes; trap -p | grep -ci hermes",
        "nosuch_hermes_cmd",
        "set -x",
        "echo traced; f y",
        "set +x",
        'echo "end $X $?"',
    ]


# After each line of the reference: print the status, then give the next line
# the same $? and $_ (a function's status and last argument), all untraced.
_STATUS = (
    "{ __dr=$? __dl=$_; builtin printf '\\n[rc=%d]\\n' \"$__dr\"; "
    '__dret() { builtin unset -f __dret; builtin unset -v __dr __dl; return "$1"; }; '
    '__dret "$__dr" "$__dl"; } 2>/dev/null'
)
_LINE_NO = re.compile(r"bash: line \d+: ")


def _normalize(text: str) -> str:
    # A long-lived bash numbers lines from its start, bash -c from each command's.
    return _LINE_NO.sub("bash: line N: ", text)


class DifferentialFixture:
    @pytest.fixture
    def environment(self) -> BaseEnvironment:
        raise NotImplementedError("a backend's test class must provide the `environment` fixture")


class DifferentialConformance(DifferentialFixture):
    def test_differential_against_one_long_lived_bash(self, environment: BaseEnvironment) -> None:
        scratch = f"/tmp/hermes_t_diff_{secrets.token_hex(6)}"
        lines = differential_lines(scratch)
        start = environment.execute("cd /tmp")
        assert start.exit_code == 0
        # The reference: one bash reading the lines, as a terminal would feed them.
        script = "shopt -s expand_aliases\n" + "".join(f"{line}\n{_STATUS}\n" for line in lines)
        ref = environment.execute("bash --norc --noprofile -s", stdin=script, timeout=120)
        expected = _normalize(ref.output).split("\n")
        got_parts = []
        for line in lines:
            r = environment.execute(line, timeout=60)
            got_parts.append(f"{r.output}\n[rc={r.exit_code}]\n")
        got = _normalize("".join(got_parts)).split("\n")
        if got != expected:
            diff = "\n".join(difflib.unified_diff(expected, got, "one long-lived bash", "execute()", lineterm=""))
            pytest.fail(f"execute() differs from one long-lived bash:\n{diff}")
        assert "[rc=7]" in got and "traced" in got  # the comparison saw the whole session


class LongLivedConformance(DifferentialFixture):
    def test_messages_read_as_bash(self, environment: BaseEnvironment) -> None:
        # As one long-lived bash words them (its line numbers count from its start).
        r = environment.execute("nosuch_hermes_x")
        assert re.fullmatch(r"bash: line \d+: nosuch_hermes_x: command not found\n", r.output) and r.exit_code == 127
        r = environment.execute("true\n\nnosuch_hermes_y")
        assert re.fullmatch(r"bash: line \d+: nosuch_hermes_y: command not found\n", r.output), r.output
        if environment.session_mode != "server":
            return
        # A syntax error reads as bash -c prints it, with no wrapper in it, and the session goes on.
        r = environment.execute("echo ok; if then")
        assert r.exit_code == 2 and "hermes" not in r.output, r.output
        assert r.output.startswith("bash: -c: line 1: syntax error near unexpected token `then'"), r.output

    def test_exit_trap_runs_once_on_exit_not_after_each_command(self, environment: BaseEnvironment) -> None:
        assert environment.execute("trap 'echo bye' EXIT; echo set").output == "set\n"
        assert environment.execute("echo one").output == "one\n"
        assert environment.execute("trap -p EXIT").output == "trap -- 'echo bye' EXIT\n"
        r = environment.execute("echo two; exit 3")
        assert r.output == "two\nbye\n" and r.exit_code == 3
        assert environment.execute("echo three; trap -p EXIT").output == "three\n"

    def test_trap_minus_exit_never_stops_saving(self, environment: BaseEnvironment) -> None:
        inherited = environment.execute("trap -p").output  # e.g. a signal the target's sshd ignores
        environment.execute("trap 'echo bye' EXIT")
        assert environment.execute("trap - EXIT; HERMES_T_KEPT=yes").exit_code == 0
        assert environment.execute('echo "$HERMES_T_KEPT"; trap -p').output == "yes\n" + inherited

    def test_state_saved_when_command_exits(self, environment: BaseEnvironment) -> None:
        r = environment.execute("HERMES_T_EX=kept; cd /; exit 9")
        assert r.exit_code == 9
        assert environment.execute('echo "$HERMES_T_EX"; pwd').output == "kept\n/\n"

    def test_nul_byte_is_a_clear_error(self, environment: BaseEnvironment) -> None:
        with pytest.raises(CommandError, match="NUL byte at offset 6"):
            environment.execute("echo a\x00b")
        long = "echo " + "x" * 200000 + "\x00"
        with pytest.raises(ValueError, match="NUL"):
            environment.execute(long)
        assert environment.execute("echo fine").output == "fine\n"

    def test_jobs_and_descriptors_kept_or_noted(self, environment: BaseEnvironment) -> None:
        r = environment.execute("exec 7>/dev/null; sleep 30 & echo $!")
        pid = r.output.strip()
        assert pid.isdigit()
        if environment.session_mode == "server":
            # The session is one shell: the job table, $! and the descriptor are still there.
            assert not any("background job" in n or "descriptor" in n for n in r.notes), r.notes
            assert environment.execute("jobs -p; echo \"$!\"").output == f"{pid}\n{pid}\n"
            assert environment.execute("echo x >&7 && echo fd7").output == "fd7\n"
            r = environment.execute("kill %1; wait %1; echo $?; exec 7>&-")
            assert r.output == "143\n", r.output
        else:
            joined = " ".join(r.notes)
            assert "descriptor(s) 7" in joined and "background job" in joined
            environment.execute(f"kill {pid}")
        clean = environment.execute("echo clean")
        assert clean.output == "clean\n"
        assert not any("background job" in n or "descriptor" in n for n in clean.notes), clean.notes

    def test_removed_state_directory_is_recreated(self, environment: BaseEnvironment) -> None:
        d = environment.session.state_dir
        r = environment.execute(f"rm -rf {shlex.quote(d)}; HERMES_T_AFTER=1")
        assert any("recreated" in n for n in r.notes), r.notes
        assert environment.execute('echo "$HERMES_T_AFTER"').output == "1\n"
        assert environment.execute(f"stat -c %a {shlex.quote(d)}").output == "700\n"

    def test_planted_fifo_and_symlink_never_block(self, environment: BaseEnvironment) -> None:
        environment.execute("true")
        d = shlex.quote(environment.session.state_dir)
        planted = environment.execute(
            f"for f in {d}/.hermes-*.state; do rm -f \"$f\"; mkfifo \"$f\"; done; "
            f"ln -sfn /nonexistent/x {d}/.hermes-planted.state; HERMES_T_PL=ok",
            timeout=30,
        )
        assert not planted.timed_out
        r = environment.execute('echo "$HERMES_T_PL"', timeout=30)
        assert not r.timed_out and r.output == "ok\n"

    def test_quoted_state_round_trips(self, environment: BaseEnvironment) -> None:
        @settings(
            max_examples=max(5, getattr(self, "hypothesis_examples", 40) // 4),
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=80))
        def check(s: str) -> None:
            q = shlex.quote(s)
            environment.execute(f"HERMES_T_Q={q}; alias hermes_t_q={shlex.quote('echo ' + q)}; echo {q} >/dev/null")
            r = environment.execute('printf "%s|%s" "$_" "$HERMES_T_Q"; hermes_t_q')
            assert r.output == f"{s}|{s}{s}\n"

        check()


_HARVEST = r"""
cands=
for f in /proc/$PPID/cmdline /proc/$PPID/environ /proc/self/environ /proc/$PPID/fd/0; do
  cands+=" $(tr '\0' ' ' <"$f" 2>/dev/null)"
done
for f in /proc/self/fd/[0-9]*; do
  case ${f##*/} in 1|2|63) continue;; esac  # write ends: reading them would take our own output
  cands+=" $(timeout 1 cat "$f" 2>/dev/null | head -c 1000000)"
done
for f in "$1"/* "$1"/.[!.]*; do  # every file of the session's own private directory
  [ -f "$f" ] && cands+=" $(head -c 4000000 "$f" 2>/dev/null)"
done
for t in $(printf '%s' "$cands" | grep -ao '[0-9a-f]\{24\}' | sort -u); do
  printf '\036%s:S0 1 0 0\037/\036%s:E\n' "$t" "$t"
  printf '\036%s:S0 1 0 0\037/\036%s:E\n' "$t" "$t" >&63 2>/dev/null
done
echo harvested
"""


class PrivacyConformance(DifferentialFixture):
    def test_no_exported_value_on_any_command_line(self, environment: BaseEnvironment) -> None:
        secret = "hermes-secret-" + secrets.token_hex(8)
        environment.execute(f"export HERMES_T_SECRET={secret}; HERMES_T_PLAIN={secret}x")
        # A process of the session runs while every command line in the target is read.
        # A duration of its own: the target may be this host, where another suite runs the same test.
        sleeper = f"sleep 60.{secrets.randbelow(10**6):06d}"
        environment.execute(f"{sleeper} >/dev/null 2>&1 &")
        try:
            dump = environment.execute(
                # first until the job has exec'd sleep (a loaded machine may not have got there yet)
                "for ((i = 0; i < 200; i++)); do for f in /proc/[0-9]*/cmdline; do "
                f"[[ $(tr '\\0' ' ' <\"$f\" 2>/dev/null) == '{sleeper} ' ]] && break 2; done; sleep 0.05; done; "
                "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <\"$f\" 2>/dev/null; echo; done",
                timeout=60,
            ).output
        finally:
            environment.execute(f"kill $! 2>/dev/null; pkill -xf '{sleeper}' 2>/dev/null; true")
        assert sleeper in dump, "the dump did not see the running command"
        assert secret not in dump, [line for line in dump.splitlines() if secret in line]

    def test_child_cannot_forge_a_frame(self, environment: BaseEnvironment) -> None:
        environment.execute("HERMES_T_BEFORE=1")
        d = shlex.quote(environment.session.state_dir)
        r = environment.execute(
            f"bash -c {shlex.quote(_HARVEST)} harvest {d}; alias hermes_t_injected=true; exit 7", timeout=120
        )
        assert "harvested" in r.output
        assert r.exit_code == 7, r.output[-2000:]
        assert not any("not saved" in n for n in r.notes), r.notes
        after = environment.execute("alias hermes_t_injected >/dev/null 2>&1 && echo saved; echo $HERMES_T_BEFORE")
        # The command's own alias is saved (it is the command's); a forged frame would have dropped it.
        assert after.output == "saved\n1\n"
