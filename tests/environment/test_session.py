"""Session-state parsing and heredoc construction."""

from __future__ import annotations

import subprocess

from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_env_core.environment.session import ansi_c_quote, kill_tree_script
from hermes_env_core.environment.shellscript import DECLARED_WORD, declared_value, stdin_statement


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=300))
def test_ansi_c_quote_round_trips_through_bash(s):
    out = subprocess.run(["bash", "-c", f"printf '%s' {ansi_c_quote(s)}"], capture_output=True)
    assert out.stdout.decode("utf-8", "surrogateescape") == s


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_heredoc_delivers_exact_bytes(data):
    script = stdin_statement(data) + "\nod -An -tx1 | tr -d ' \\n'\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert out.stdout == data.hex()


def test_kill_tree_script_kills_descendants():
    p = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 301 & wait"], start_new_session=False)
    try:
        kids: list[str] = []

        def two_children() -> bool:
            kids[:] = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            return len(kids) == 2

        from hermes_env_core.testing import wait_until

        assert wait_until(two_children, 10)
        subprocess.run(["bash", "-c", kill_tree_script(p.pid, "KILL")], check=True)
        p.wait(timeout=5)

        def dead(k: str) -> bool:  # gone, or a zombie nobody reaps
            try:
                with open(f"/proc/{k}/stat") as f:
                    return f.read().split(") ")[1][0] in "ZX"
            except FileNotFoundError:
                return True

        from hermes_env_core.testing import wait_until

        assert wait_until(lambda: all(dead(k) for k in kids), 10)
    finally:
        if p.poll() is None:
            p.kill()


def test_script_mode_without_ln_falls_back_to_eval():
    # A target whose private directory cannot hold the ./bash link (no ln in a
    # minimal image): an xtrace session still runs and keeps its state.
    from hermes_env_core.backends.local import LocalEnvironment

    with LocalEnvironment() as env:
        env.execute("true")
        with open(f"{env.session.state_dir}/bash", "w") as f:
            f.write("not a link\n")
        r = env.execute("set -x; HERMES_T_FB=1; echo hi")
        assert r.exit_code == 0 and "echo hi" in r.output and r.output.endswith("hi\n"), r.output
        assert not any("not saved" in n for n in r.notes), r.notes
        r = env.execute("set +x; echo $HERMES_T_FB")
        assert r.output.endswith("1\n")
        assert env.execute("echo plain").output == "plain\n"


@settings(max_examples=150, deadline=None)
@given(value=st.binary(max_size=30).filter(lambda b: b"\0" not in b))
def test_declared_words_decode_as_bash_printed_them(value: bytes) -> None:
    """declare -p quotes a value as "..." or $'...'; declared_value reads back the same bytes."""
    text = value.decode("utf-8", "surrogateescape")
    script = f"V={ansi_c_quote(text)}; A=(x {ansi_c_quote(text)}); declare -p V A".encode("utf-8", "surrogateescape")
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout.decode("utf-8", "surrogateescape")
    words = [declared_value(m) for m in DECLARED_WORD.finditer(out)]
    assert words == [text, "x", text]
