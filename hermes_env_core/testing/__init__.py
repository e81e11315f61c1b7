"""The conformance suite every backend's tests subclass.

A backend's test module is one class combining ``EnvironmentConformance`` with
an ``environment`` fixture that yields a fresh session (a reused container or
connection is fine; a fresh shell state is required)::

    class TestMyBackend(EnvironmentConformance):
        @pytest.fixture
        def environment(self):
            with MyEnvironment(...) as env:
                yield env

Adding a test here changes the contract for every backend.
"""

from __future__ import annotations

import secrets
import shlex
import threading
import time
from collections.abc import Callable
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..environment.base import BaseEnvironment
from ..environment.result import EXIT_CANCELLED, EXIT_CWD, EXIT_TIMEOUT
from .guard import CAPABILITIES, check_suite_class
from .longlived import DifferentialConformance, LongLivedConformance, PrivacyConformance

__all__ = [
    "CAPABILITIES",
    "BackgroundConformance",
    "CancelConformance",
    "CwdConformance",
    "DifferentialConformance",
    "EnvironmentConformance",
    "EnvironmentFixture",
    "ExitCodeConformance",
    "LongLivedConformance",
    "OutputConformance",
    "PrivacyConformance",
    "QuotingConformance",
    "StateConformance",
    "StdinConformance",
    "TimeoutConformance",
    "wait_until",
]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; returns whether it held."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# Is a process alive and not a zombie? Pure bash, so it works in minimal images.
_ALIVE = (
    'alive() { local s; [ -r /proc/$1/stat ] || return 1; IFS= read -r s </proc/$1/stat || return 1; '
    's=${s##*) }; [ "${s%% *}" != Z ]; }; '
)

def _scratch(name: str) -> str:
    """A path in the target's /tmp that no other test, user or run shares."""
    return f"/tmp/hermes_t_{name}_{secrets.token_hex(6)}"


_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=200)


class EnvironmentFixture:
    """Declares the fixture and the knobs a backend may set."""

    #: examples per property-based test; remote backends may lower it
    hypothesis_examples: int = 40
    #: seconds of slack added to timing assertions on slow backends
    timing_slack: float = 2.0
    #: tests of this suite the backend is known to fail, name -> why; they run
    #: and are reported as expected failures, never silently skipped
    known_gaps: ClassVar[dict[str, str]] = {}
    #: capabilities (``guard.CAPABILITIES``) this backend lacks, name -> why: their
    #: tests then pass only if the operation raises ``UnsupportedOperation``
    unsupported: ClassVar[dict[str, str]] = {}
    #: suite tests this class overrides or deletes, name -> why (else the class fails to build)
    overrides: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        check_suite_class(cls)

    @pytest.fixture(autouse=True)
    def _known_gap(self, request: pytest.FixtureRequest) -> None:
        for name in self.known_gaps:
            if not name.startswith("test_") or not callable(getattr(type(self), name, None)):
                pytest.fail(f"known_gaps names {name!r}, which is not a test of the suite")
        reason = self.known_gaps.get(getattr(request.node, "originalname", "") or request.node.name)
        if reason:
            request.applymarker(pytest.mark.xfail(reason=f"known gap of this backend: {reason}", strict=False))

    @pytest.fixture
    def environment(self) -> BaseEnvironment:
        raise NotImplementedError("a backend's test class must provide the `environment` fixture")


class OutputConformance(EnvironmentFixture):
    def test_echo(self, environment: BaseEnvironment) -> None:
        r = environment.execute("echo hello")
        assert r.output == "hello\n"
        assert r.exit_code == 0 and not r.timed_out and not r.truncated

    def test_stdout_and_stderr_merged_in_order(self, environment: BaseEnvironment) -> None:
        r = environment.execute("echo out1; echo err1 >&2; echo out2; echo err2 >&2")
        assert r.output == "out1\nerr1\nout2\nerr2\n"

    def test_no_final_newline_kept(self, environment: BaseEnvironment) -> None:
        assert environment.execute("printf abc").output == "abc"

    def test_empty_output(self, environment: BaseEnvironment) -> None:
        assert environment.execute("true").output == ""

    def test_look_alike_markers_pass_through(self, environment: BaseEnvironment) -> None:
        fake = "\\036deadbeefdeadbeefdeadbeef:S0 1 2 0\\n/x\\036deadbeef:E\\n#hermes-state:abc\\n"
        r = environment.execute(f"printf '{fake}'; echo tail")
        assert r.output == (
            "\x1edeadbeefdeadbeefdeadbeef:S0 1 2 0\n/x\x1edeadbeef:E\n#hermes-state:abc\ntail\n"
        )

    def test_invalid_utf8_replaced(self, environment: BaseEnvironment) -> None:
        r = environment.execute(r"printf 'a\xff\xfeb\000c'")
        assert r.output == "a\ufffd\ufffdb\x00c"

    def test_multibyte_split_across_reads(self, environment: BaseEnvironment) -> None:
        # 3-byte characters over several 64 KiB reads: boundaries fall mid-character.
        r = environment.execute("for i in $(seq 1 300); do printf '€%.0s' {1..300}; done")
        assert r.output == "€" * 90000

    def test_large_output_bounded(self, environment: BaseEnvironment) -> None:
        limit = environment.config.max_output_bytes
        r = environment.execute("head -c 50000000 /dev/zero | tr '\\0' a; echo; echo END")
        assert r.exit_code == 0
        assert r.truncated
        assert r.output.startswith("a" * 1000)
        assert r.output.endswith("a\nEND\n")
        assert "bytes omitted" in r.output
        assert r.dropped_bytes > 50000000 - limit - 1
        assert len(r.output.encode()) < limit + 200

    def test_output_under_limit_exact(self, environment: BaseEnvironment) -> None:
        n = min(environment.config.max_output_bytes // 2, 300000)
        r = environment.execute(f"head -c {n} /dev/zero | tr '\\0' b")
        assert r.output == "b" * n and not r.truncated


class ExitCodeConformance(EnvironmentFixture):
    @pytest.mark.parametrize("code", [0, 1, 2, 42, 255])
    def test_exit_code(self, environment: BaseEnvironment, code: int) -> None:
        assert environment.execute(f"exit {code}").exit_code == code

    def test_last_command_status(self, environment: BaseEnvironment) -> None:
        assert environment.execute("true; false").exit_code == 1

    def test_command_not_found(self, environment: BaseEnvironment) -> None:
        r = environment.execute("no_such_command_hermes")
        assert r.exit_code == 127
        assert "no_such_command_hermes" in r.output
        assert "__hermes" not in r.output

    def test_syntax_error_is_reported_and_session_survives(self, environment: BaseEnvironment) -> None:
        r = environment.execute("echo 'unterminated")
        assert r.exit_code == 2
        assert environment.execute("echo fine").output == "fine\n"

    def test_duration_recorded(self, environment: BaseEnvironment) -> None:
        r = environment.execute("sleep 0.2")
        assert r.duration_s >= 0.2


class StateConformance(EnvironmentFixture):
    def test_exported_variable_persists(self, environment: BaseEnvironment) -> None:
        environment.execute("export HERMES_T_EXP='a b'")
        assert environment.execute('printf %s "$HERMES_T_EXP"').output == "a b"
        assert environment.execute('bash -c \'printf %s "$HERMES_T_EXP"\'').output == "a b"

    def test_plain_variable_persists_unexported(self, environment: BaseEnvironment) -> None:
        environment.execute("HERMES_T_PLAIN=42")
        assert environment.execute('echo "$HERMES_T_PLAIN"').output == "42\n"
        assert environment.execute("bash -c 'echo \"${HERMES_T_PLAIN-unset}\"'").output == "unset\n"

    def test_arrays_persist(self, environment: BaseEnvironment) -> None:
        environment.execute("arr=(one 'two words' $'new\\nline'); declare -A m=([k]=v)")
        r = environment.execute('printf "<%s>" "${arr[@]}" "${m[k]}"')
        assert r.output == "<one><two words><new\nline><v>"

    def test_unset_persists(self, environment: BaseEnvironment) -> None:
        environment.execute("export HERMES_T_GONE=1")
        environment.execute("unset HERMES_T_GONE")
        assert environment.execute('echo "${HERMES_T_GONE-unset}"').output == "unset\n"

    def test_unset_of_inherited_variable_persists(self, environment: BaseEnvironment) -> None:
        environment.execute("unset HOME")
        assert environment.execute('echo "${HOME-unset}"').output == "unset\n"

    def test_function_persists(self, environment: BaseEnvironment) -> None:
        environment.execute("greet() { echo \"hi $1\"; }")
        assert environment.execute("greet you").output == "hi you\n"

    def test_alias_persists(self, environment: BaseEnvironment) -> None:
        environment.execute("alias hermes_ll='echo aliased'")
        assert environment.execute("hermes_ll").output == "aliased\n"

    def test_cd_persists_and_is_reported(self, environment: BaseEnvironment) -> None:
        d = _scratch("dir")
        r = environment.execute(f"mkdir -p {d} && cd {d}")
        assert r.cwd == d
        assert environment.execute("pwd").output == f"{d}\n"
        assert environment.session.cwd == d

    def test_set_o_and_shopt_persist(self, environment: BaseEnvironment) -> None:
        environment.execute("set -o pipefail; shopt -s extglob nullglob")
        r = environment.execute("false | true; echo $?; shopt -q extglob && shopt -q nullglob && echo both")
        assert r.output == "1\nboth\n"
        environment.execute("set +o pipefail; shopt -u nullglob")
        assert environment.execute("false | true; echo $?; shopt -q nullglob || echo off").output == "0\noff\n"

    def test_function_using_extglob_survives_restore(self, environment: BaseEnvironment) -> None:
        # The function body only parses with extglob on: options come back before functions.
        environment.execute("shopt -s extglob")
        environment.execute("pick() { case $1 in @(a|b)) echo ab;; *) echo other;; esac; }")
        assert environment.execute("pick a; pick z").output == "ab\nother\n"

    def test_errexit_and_nounset_persist_without_breaking_the_wrapper(self, environment: BaseEnvironment) -> None:
        environment.execute("set -eu")
        r = environment.execute('echo "$HERMES_T_UNDEFINED"; echo not-reached')
        assert r.exit_code != 0 and "not-reached" not in r.output
        assert environment.execute("echo ok").output == "ok\n"

    def test_xtrace_shows_only_the_users_commands(self, environment: BaseEnvironment) -> None:
        environment.execute("set -x")
        r = environment.execute("echo traced")
        assert r.output == "+ echo traced\ntraced\n"

    def test_umask_persists(self, environment: BaseEnvironment) -> None:
        environment.execute("umask 027")
        assert environment.execute("umask").output == "0027\n"

    def test_state_kept_after_exit_n(self, environment: BaseEnvironment) -> None:
        r = environment.execute("export HERMES_T_EXIT=kept; cd /; exit 7")
        assert r.exit_code == 7
        assert environment.execute('echo "$HERMES_T_EXIT"; pwd').output == "kept\n/\n"

    def test_state_kept_after_set_e_failure(self, environment: BaseEnvironment) -> None:
        r = environment.execute("set -e; HERMES_T_SE=yes; false; HERMES_T_SE=no")
        assert r.exit_code == 1
        assert environment.execute('set +e; echo "$HERMES_T_SE"').output == "yes\n"

    def test_excluded_prefix_never_saved(self, environment: BaseEnvironment) -> None:
        environment.execute("export HERMES_SESSION_TOKEN=secret; HERMES_T_KEPT=1")
        r = environment.execute('echo "${HERMES_SESSION_TOKEN-unset} $HERMES_T_KEPT"')
        # A session server holds it as one bash would; it never enters the saved state.
        assert r.output == ("secret 1\n" if environment.session_mode == "server" else "unset 1\n")
        state = environment.session.state
        assert state is not None and "HERMES_T_KEPT" in state.variables
        assert "HERMES_SESSION_TOKEN" not in state.variables

    def test_concurrent_calls_never_tear_state(self, environment: BaseEnvironment) -> None:
        def run(i: int) -> None:
            environment.execute(f"HERMES_T_A={i}; HERMES_T_B={i}; sleep 0.0{i % 5}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        a, b = environment.execute('echo "$HERMES_T_A $HERMES_T_B"').output.split()
        assert a == b and a in {str(i) for i in range(8)}

    def test_large_state_round_trips(self, environment: BaseEnvironment) -> None:
        # Larger than one argv string may be (128 KiB): the backend must cope.
        environment.execute("HERMES_T_BIG=$(head -c 200000 /dev/zero | tr '\\0' x)")
        assert environment.execute('echo "${#HERMES_T_BIG}"').output == "200000\n"


class CwdConformance(EnvironmentFixture):
    def test_missing_cwd_is_126_naming_it(self, environment: BaseEnvironment) -> None:
        r = environment.execute("pwd", cwd="/no/such/hermes/dir")
        assert r.exit_code == EXIT_CWD
        assert "/no/such/hermes/dir" in r.output

    def test_explicit_cwd_is_one_off(self, environment: BaseEnvironment) -> None:
        before = environment.execute("pwd").output
        assert environment.execute("pwd", cwd="/").output == "/\n"
        assert environment.execute("pwd").output == before

    def test_session_cwd_removed_recovers(self, environment: BaseEnvironment) -> None:
        d = _scratch("rm")
        environment.execute(f"mkdir -p {d} && cd {d}")
        environment.execute(f"rmdir {d}")
        r = environment.execute("pwd")
        if environment.session_mode == "server":
            # As one bash: the next command runs in the deleted directory.
            assert r.exit_code == 0 and r.output == f"{d}\n", r.output
        else:
            assert r.exit_code == EXIT_CWD and d in r.output
            assert any("reset" in n for n in r.notes)
        assert environment.execute("echo back").exit_code == 0


class StdinConformance(EnvironmentFixture):
    def test_stdin_text(self, environment: BaseEnvironment) -> None:
        assert environment.execute("cat", stdin="line1\nline2\n").output == "line1\nline2\n"

    def test_stdin_without_final_newline_exact(self, environment: BaseEnvironment) -> None:
        assert environment.execute("wc -c", stdin="abc").output.strip() == "3"

    def test_stdin_bytes(self, environment: BaseEnvironment) -> None:
        r = environment.execute("od -An -tx1 | tr -d ' \\n'", stdin=b"\x00\xff\x01")
        assert r.output == "00ff01"

    def test_no_stdin_means_eof(self, environment: BaseEnvironment) -> None:
        r = environment.execute("cat; echo done", timeout=10)
        assert r.output == "done\n" and not r.timed_out

    def test_stdin_looking_like_delimiters(self, environment: BaseEnvironment) -> None:
        data = "EOF\nHERMES_EOF\n'\"$(echo no)`echo no`\n"
        assert environment.execute("cat", stdin=data).output == data

    def test_large_stdin(self, environment: BaseEnvironment) -> None:
        data = "x" * 300000 + "\n"
        assert environment.execute("wc -c", stdin=data).output.strip() == "300001"


class QuotingConformance(EnvironmentFixture):
    def test_arbitrary_strings_round_trip(self, environment: BaseEnvironment) -> None:
        @settings(
            max_examples=self.hypothesis_examples,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(_text)
        def check(s: str) -> None:
            assert environment.execute(f"printf '%s' {shlex.quote(s)}").output == s

        check()

    def test_arbitrary_stdin_round_trips(self, environment: BaseEnvironment) -> None:
        @settings(
            max_examples=self.hypothesis_examples,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(_text)
        def check(s: str) -> None:
            assert environment.execute("cat", stdin=s).output == s

        check()

    def test_heredoc_in_command(self, environment: BaseEnvironment) -> None:
        r = environment.execute("cat <<'EOF'\n$HOME `x` \\n\nEOF")
        assert r.output == "$HOME `x` \\n\n"

    def test_multiline_command(self, environment: BaseEnvironment) -> None:
        r = environment.execute("for i in 1 2; do\n  echo $i\ndone\nif true; then echo t; fi")
        assert r.output == "1\n2\nt\n"


class TimeoutConformance(EnvironmentFixture):
    def test_timeout_returns_partial_output(self, environment: BaseEnvironment) -> None:
        r = environment.execute("echo before; sleep 30; echo after", timeout=1)
        assert r.exit_code == EXIT_TIMEOUT and r.timed_out
        assert r.output.startswith("before\n") and "after" not in r.output
        assert r.duration_s < 1 + self.timing_slack + environment.config.kill_grace_s

    def test_timeout_kills_the_tree(self, environment: BaseEnvironment) -> None:
        f = _scratch("child")
        r = environment.execute(f"sleep 600 & echo $! >{f}; sleep 600", timeout=1)
        assert r.timed_out
        pid = environment.execute(f"cat {f}").output.strip()
        assert pid.isdigit()
        gone = wait_until(lambda: environment.execute(_ALIVE + f"alive {pid}").exit_code != 0, 10)
        assert gone, f"child {pid} survived the timeout"

    def test_trapped_sigterm_still_killed(self, environment: BaseEnvironment) -> None:
        r = environment.execute("trap 'echo got-term' TERM; while :; do sleep 0.1; done", timeout=1)
        assert r.timed_out
        assert r.duration_s < 1 + environment.config.kill_grace_s + self.timing_slack

    def test_environment_usable_after_timeout(self, environment: BaseEnvironment) -> None:
        environment.execute("export HERMES_T_BEFORE=1")
        environment.execute("sleep 30", timeout=0.5)
        assert environment.execute('echo "$HERMES_T_BEFORE"').output == "1\n"

    def test_default_timeout_from_config(self, environment: BaseEnvironment) -> None:
        assert environment.config.timeout is None or environment.config.timeout > 0

    def _gone_after_timeout(self, environment: BaseEnvironment, command: str, pidfile: str) -> None:
        r = environment.execute(command, timeout=1)
        assert r.timed_out
        pid = environment.execute(f"cat {pidfile}").output.strip()
        assert pid.isdigit(), f"the command did not record its child: {pid!r}"
        gone = wait_until(lambda: environment.execute(_ALIVE + f"alive {pid}").exit_code != 0, 15)
        assert gone, f"child {pid} survived the timeout"

    def test_timeout_kills_a_child_that_ignores_term_after_bash_exited(self, environment: BaseEnvironment) -> None:
        # bash dies on SIGTERM; the child ignores it and must still get SIGKILL.
        f = _scratch("ignterm")
        self._gone_after_timeout(
            environment, f"bash -c 'trap \"\" TERM; echo $$ >{f}; exec sleep 600' & wait", f
        )

    def test_timeout_kills_a_setsid_descendant(self, environment: BaseEnvironment) -> None:
        f = _scratch("setsid")
        self._gone_after_timeout(
            environment,
            f"setsid bash -c 'trap \"\" TERM; echo $$ >{f}; exec sleep 600' </dev/null >/dev/null 2>&1 & sleep 600",
            f,
        )

    @pytest.mark.parametrize("bad", [0, -5, float("nan")])
    def test_timeout_must_be_positive(self, environment: BaseEnvironment, bad: float) -> None:
        with pytest.raises(ValueError, match="timeout") as info:
            environment.execute("echo never", timeout=bad)
        assert repr(bad) in str(info.value)

    def test_raising_output_callback_stops_the_command(self, environment: BaseEnvironment) -> None:
        f = _scratch("cb")

        class Stop(Exception):
            pass

        def boom(text: str) -> None:
            if "started" in text:
                raise Stop

        with pytest.raises(Stop):
            environment.execute(f"sleep 600 & echo $! >{f}; echo started; wait", on_output=boom, timeout=60)
        pid = environment.execute(f"cat {f}").output.strip()
        assert pid.isdigit()
        gone = wait_until(lambda: environment.execute(_ALIVE + f"alive {pid}").exit_code != 0, 15)
        assert gone, f"child {pid} survived the failed callback"


class CancelConformance(EnvironmentFixture):
    def test_cancel_from_another_thread(self, environment: BaseEnvironment) -> None:
        cancel = threading.Event()
        seen = threading.Event()

        def on_output(text: str) -> None:
            if "ready" in text:
                seen.set()

        def trigger() -> None:
            if seen.wait(30):
                cancel.set()

        t = threading.Thread(target=trigger)
        t.start()
        r = environment.execute("echo ready; sleep 60; echo no", cancel=cancel, on_output=on_output, timeout=90)
        t.join()
        assert r.exit_code == EXIT_CANCELLED and r.interrupted and not r.timed_out
        assert r.output == "ready\n"
        assert r.duration_s < 30
        assert environment.execute("echo alive").output == "alive\n"


class BackgroundConformance(EnvironmentFixture):
    def test_background_child_returns_promptly(self, environment: BaseEnvironment) -> None:
        r = environment.execute("sleep 300 & echo $!")
        assert r.exit_code == 0
        pid = r.output.strip()
        assert r.duration_s < 0.5 + self.timing_slack / 4
        assert environment.execute(_ALIVE + f"alive {pid} && echo running").output == "running\n"
        environment.execute(f"kill {pid}")

    def test_setsid_disown_returns_promptly(self, environment: BaseEnvironment) -> None:
        r = environment.execute("setsid sleep 300 & disown; echo $!")
        pid = r.output.strip()
        assert pid.isdigit()
        assert r.duration_s < 0.5 + self.timing_slack / 4
        assert environment.execute(_ALIVE + f"alive {pid} && echo running").output == "running\n"
        environment.execute(f"kill {pid}")

    def test_server_with_redirected_output(self, environment: BaseEnvironment) -> None:
        log = _scratch("srv.log")
        r = environment.execute(
            f"(for i in 1 2 3; do echo tick $i; sleep 0.1; done; exec sleep 300) >{log} 2>&1 & echo $!"
        )
        pid = r.output.strip()
        assert pid.isdigit() and r.duration_s < 0.5 + self.timing_slack / 4
        assert wait_until(lambda: "tick 3" in environment.execute(f"cat {log}").output, 10)
        environment.execute(f"kill {pid}")


class EnvironmentConformance(
    OutputConformance,
    ExitCodeConformance,
    StateConformance,
    CwdConformance,
    StdinConformance,
    QuotingConformance,
    TimeoutConformance,
    CancelConformance,
    BackgroundConformance,
    DifferentialConformance,
    LongLivedConformance,
    PrivacyConformance,
):
    """Every behaviour of the ``execute()`` contract."""
