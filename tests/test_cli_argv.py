"""``hermes-env run WORD...``: several words are one argv (quoted as docker exec takes them); one word is a
shell command line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hermes_env_core.cli import main

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")
SHOW_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"

# What a program can receive as one argument: any text but NUL (and no lone surrogates, which are not text).
WORD = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(("TERMINAL_", "HERMES_ENV_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def _run(*words: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", *words])
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(WORD, max_size=6))
def test_every_list_of_words_reaches_the_program_as_its_argv(words):
    code, out, err = _run(sys.executable, "-c", SHOW_ARGV, *words)
    assert code == 0, err
    assert json.loads(out) == words


def test_the_issue_example_runs_python_with_its_argument():
    proc = subprocess.run(
        [HERMES_ENV, "run", "python3", "-c", "print(1)"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (0, "1\n"), proc.stderr


def test_words_with_shell_syntax_stay_words():
    code, out, _ = _run("echo", "a;", "$HOME", "`id`", "|", "*")
    assert (code, out) == (0, "a; $HOME `id` | *\n")


def test_one_word_is_a_shell_command_line():
    code, out, _ = _run("X=5; for i in 1 2; do echo $i$X; done | tac")
    assert (code, out) == (0, "25\n15\n")


def test_double_dash_before_the_words_is_not_one_of_them():
    code, out, _ = _run("--", sys.executable, "-c", SHOW_ARGV, "--", "-x")
    assert (code, json.loads(out)) == (0, ["--", "-x"])
