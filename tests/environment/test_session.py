"""Session-state parsing and heredoc construction."""

from __future__ import annotations

import subprocess

from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_env_core.environment.session import ansi_c_quote, kill_tree_script
from hermes_env_core.environment.shellscript import stdin_statement


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
