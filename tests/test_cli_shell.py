"""``hermes-env shell`` in a pseudo-terminal, as a user types: history, continuation lines, Tab completion,
the status in the prompt, no default timeout, and a ``read`` that meets end of input."""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from hermes_env_core.cli.common import environment
from hermes_env_core.cli.shell import history_path, is_incomplete

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")
WAIT = 30
PROMPT = r"\(local\) [^\r\n]*\$ "


def _env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    env.update(TERM="dumb", INPUTRC="/dev/null", XDG_STATE_HOME=str(state), **extra)
    return env


@pytest.fixture
def shell(tmp_path):
    children: list[pexpect.spawn] = []

    def start(*args: str, state: Path | None = None, **extra: str) -> pexpect.spawn:
        child = pexpect.spawn(
            HERMES_ENV, ["shell", *args], cwd=str(tmp_path), env=_env(state or tmp_path / "state", **extra),
            encoding="utf-8", timeout=WAIT, dimensions=(40, 200),
        )
        children.append(child)
        child.expect(PROMPT)
        return child

    yield start
    for child in children:
        child.close(force=True)


def _run(child: pexpect.spawn, line: str, prompt: str = PROMPT) -> str:
    child.sendline(line)
    child.expect(prompt)
    return child.before


def test_history_is_kept_across_sessions_in_the_xdg_state_directory(shell, tmp_path):
    state = tmp_path / "state"
    child = shell(state=state)
    _run(child, 'echo "hist""ory-one"')
    child.sendline("exit")
    child.expect(pexpect.EOF)
    path = state / "hermes-env" / "shell_history"
    assert 'echo "hist""ory-one"' in path.read_text().splitlines()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    child = shell(state=state)
    child.send("\x1b[A\x1b[A")  # Up, Up: the line before `exit` in the earlier session
    child.sendline("")
    child.expect("history-one")
    child.expect(PROMPT)
    assert history_path({"XDG_STATE_HOME": str(state)}) == path
    assert history_path({"HERMES_ENV_HISTFILE": ""}) is None


def test_an_unfinished_command_continues_on_the_next_line(shell):
    child = shell()
    child.sendline("for i in 1 2; do")
    child.expect("\r\n> ")
    child.sendline('  echo "n=$i"')
    child.expect("> ")
    child.sendline("done")
    child.expect(PROMPT)
    assert re.findall(r"n=\d", child.before) == ["n=1", "n=2"]
    child.sendline("echo 'first")
    child.expect("> ")
    child.sendline("second'")
    child.expect(PROMPT)
    assert "first\r\nsecond" in child.before
    child.sendline("cat <<END")
    child.expect("> ")
    child.sendline("in a heredoc")
    child.expect("> ")
    child.sendline("END")
    child.expect(PROMPT)
    assert "in a heredoc" in child.before
    child.sendline("if true")
    child.expect("> ")
    child.send("\x03")  # Ctrl-C drops the unfinished command, as in bash
    child.expect(PROMPT)
    assert "n=2" in _run(child, 'echo "n=$i"')  # the loop's variable survived in the session


@pytest.mark.parametrize(
    "text, more",
    [
        ("for i in 1 2; do", True), ("if true; then", True), ("echo 'a", True), ('echo "a', True),
        ("cat <<EOF\nx", True), ("echo a \\", True), ("f() {", True), ("echo $(", True),
        ("echo done", False), ("cat <<EOF\nx\nEOF", False), ("echo a \\\\", False), ("fi", False), ("", False),
    ],
)
def test_completeness_is_what_bash_n_says(text, more):
    assert is_incomplete(text) is more


def test_tab_completes_commands_variables_and_paths_from_the_session(shell, tmp_path):
    (tmp_path / "compdir_abc").mkdir()
    child = shell()
    _run(child, "zzfunc_hermes() { echo from-func; }; ZZVAR_HERMES=42")
    child.send("zzfunc_her\t")
    child.expect("zzfunc_hermes")
    child.sendline("")
    child.expect("from-func")
    child.expect(PROMPT)
    child.send("echo $ZZVAR_HE\t")
    child.expect(r"\$ZZVAR_HERMES")
    child.sendline("")
    child.expect("42")
    child.expect(PROMPT)
    child.send("ls -d compdir_a\t")
    child.expect("compdir_abc/")
    child.sendline("")
    child.expect(PROMPT)
    # Completion runs in a subshell of the session: its own variables never leak into it.
    _run(child, "f=mine")
    child.send("echo f=$f; ls -d compd\t")
    child.expect("compdir_abc/")
    child.sendline("")
    child.expect(r"f=mine")
    child.expect(PROMPT)


def test_the_prompt_shows_a_non_zero_status(shell):
    child = shell()
    child.sendline("(exit 3)")
    child.expect(r"\(local\) [^\r\n]* \[3\]\$ ")
    child.sendline("true")
    child.expect(r"\(local\) [^\r\n\[]*\$ ")


def test_no_default_timeout_in_the_shell_unless_given(shell, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith(("TERMINAL_", "HERMES_ENV_")):
            monkeypatch.delenv(key)
    args = argparse.Namespace(env=None, option=[], config_file=None, timeout=None)
    with environment(args, no_default_timeout=True) as env:
        assert env.config.timeout is None
    monkeypatch.setenv("TERMINAL_TIMEOUT", "7")  # a timeout the user configured still applies
    with environment(args, no_default_timeout=True) as env:
        assert env.config.timeout == 7
    child = shell("--timeout", "1")
    child.sendline("sleep 20")
    child.expect(r"timed out after 1s")
    child.expect(r"\[124\]\$ ")


def test_a_read_at_end_of_input_says_so(shell):
    child = shell()
    child.sendline("read answer")
    child.expect("`read` saw end of input")
    child.expect(r"\[1\]\$ ")


def test_piped_input_runs_multi_line_commands_whole(tmp_path):
    script = "for i in a b; do\n  echo \"x$i\"\ndone\ncat <<E\nhere\nE\n"
    proc = subprocess.run(
        [HERMES_ENV, "shell"], input=script, capture_output=True, text=True, env=_env(tmp_path), timeout=WAIT,
    )
    assert (proc.returncode, proc.stdout) == (0, "xa\nxb\nhere\n"), proc.stderr
