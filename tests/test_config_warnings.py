"""A misspelt setting (``TERMINAL_TIMOUT``, ``timout`` under ``[terminal]``) is reported where it matters:
a one-line warning with "did you mean" on every command that reads the configuration, and a
``ConfigWarning`` in Python, pointing at the caller's line."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from hermes_env_core import create_environment
from hermes_env_core.config import ConfigWarning, resolve_config

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(("TERMINAL_", "HERMES_ENV_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def test_a_misspelt_variable_warns_in_python_at_the_callers_line(monkeypatch):
    monkeypatch.setenv("TERMINAL_TIMOUT", "5")
    with pytest.warns(ConfigWarning, match=r"TERMINAL_TIMOUT is ignored.*did you mean TERMINAL_TIMEOUT\?") as rec:
        env = create_environment()
    env.close()
    assert [w.filename for w in rec if issubclass(w.category, ConfigWarning)] == [__file__]


def test_a_misspelt_key_of_the_terminal_table_warns(tmp_path):
    (tmp_path / "hermes-env.toml").write_text("[terminal]\ntimout = 30\n")
    with pytest.warns(ConfigWarning, match=r"'timout' in .*hermes-env.toml \[terminal\].*did you mean 'timeout'\?"):
        resolved = resolve_config()
    assert resolved.values["timeout"].source == "default"


def test_a_near_miss_of_another_backends_option_names_it(monkeypatch):
    monkeypatch.setenv("TERMINAL_IMAEG", "python:3.12")
    with pytest.warns(ConfigWarning, match="did you mean TERMINAL_IMAGE"):
        resolve_config("local")


def test_options_of_another_backend_and_foreign_variables_stay_quiet(monkeypatch, tmp_path):
    monkeypatch.setenv("TERMINAL_IMAGE", "python:3.12")  # docker's, shared by the environment: not a typo
    monkeypatch.setenv("TERMINAL_SOMETHING_ELSE_ENTIRELY", "1")  # another program's, nothing close
    (tmp_path / "hermes-env.toml").write_text('[terminal]\nimage = "python:3.12"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        resolved = resolve_config("local")
    assert {i.key for i in resolved.ignored} == {"image", "something_else_entirely"}


def _cli(*args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    return subprocess.run(
        [HERMES_ENV, *args], input=input if input is not None else "", capture_output=True, text=True,
        env={**environ, **env}, timeout=120,
    )


@pytest.mark.parametrize("args, stdin", [
    (("run", "echo ran"), None),
    (("shell",), "echo ran\n"),
    (("mcp",), None),  # stdio: serves until its input ends
], ids=["run", "shell", "mcp"])
def test_every_command_that_reads_the_configuration_warns_once_per_setting(tmp_path, args, stdin):
    (tmp_path / "hermes-env.toml").write_text("[terminal]\ntimout = 30\n")
    proc = _cli(*args, input=stdin, TERMINAL_TIMOUT="7", TERMINAL_CPUS="2")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("hermes-env: warning:")]
    assert sorted(warned) == sorted([
        "hermes-env: warning: 'timout' in {} [terminal] is ignored: no backend has an option 'timout'; "
        "did you mean 'timeout'?".format(tmp_path / "hermes-env.toml"),
        "hermes-env: warning: TERMINAL_CPUS is ignored: no backend has an option 'cpus'; did you mean TERMINAL_CPU?",
        "hermes-env: warning: TERMINAL_TIMOUT is ignored: no backend has an option 'timout'; "
        "did you mean TERMINAL_TIMEOUT?",
    ]), proc.stderr
    if args[0] != "mcp":
        assert proc.stdout == "ran\n"


def test_config_lists_them_instead_of_warning(tmp_path):
    proc = _cli("config", TERMINAL_TIMOUT="5")
    assert proc.returncode == 0 and "warning" not in proc.stderr
    assert "TERMINAL_TIMOUT" in proc.stdout and "did you mean 'timeout'" in proc.stdout
