"""The hermes-env command, driven as a user drives it: subprocesses, stdin scripts and a pty."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import importlib.metadata as importlib_metadata
import pytest

from hermes_env_core import API_VERSION, BackendRegistry, BackendSpec, hookimpl
from hermes_env_core.cli import info as cli_module
from hermes_env_core import factory as factory_module
from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.cli import main
from hermes_env_core.plugins import builtin

WAIT = 20.0


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(("TERMINAL_", "HERMES_ENV_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    env.update(extra)
    return env


#: The console script pip installed next to this interpreter: what a user runs.
HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")


def cli(*args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HERMES_ENV, *args],
        input=input,
        capture_output=True,
        text=True,
        env=clean_env(**env),
        timeout=WAIT * 3,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


def run_main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_the_console_script_is_declared():
    [ep] = [ep for ep in importlib_metadata.entry_points(group="console_scripts") if ep.name == "hermes-env"]
    assert ep.value == "hermes_env_core.cli:main"


# -- run -----------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [0, 1, 3, 42, 255])
def test_run_passes_the_exit_status_through(status):
    proc = cli("run", f"echo out; echo err >&2; exit {status}")
    assert proc.returncode == status
    assert proc.stdout == "out\nerr\n"  # merged, in order, on our stdout


def test_run_joins_words_and_accepts_options_before_the_command():
    assert cli("run", "echo", "a", "b").stdout == "a b\n"
    proc = cli("run", "--timeout", "30", "--", "ls", "-d", "/")
    assert (proc.returncode, proc.stdout) == (0, "/\n")


def test_run_cwd_and_a_directory_that_cannot_be_entered(tmp_path):
    assert cli("run", "--cwd", str(tmp_path), "pwd").stdout == f"{tmp_path}\n"
    proc = cli("run", "--cwd", str(tmp_path / "missing"), "pwd")
    assert proc.returncode == 126 and "missing" in proc.stdout


def test_run_timeout_gives_124_and_says_so():
    started = time.monotonic()
    proc = cli("run", "--timeout", "0.5", "echo begun; sleep 30")
    assert proc.returncode == 124 and time.monotonic() - started < 20
    assert proc.stdout == "begun\n" and "timed out" in proc.stderr


def test_run_options_and_stdin():
    proc = cli(
        "run",
        "--option",
        'env={"WHO": "you"}',
        "-o",
        "inherit_env=false",
        "--stdin",
        'echo "$WHO"; cat',
        input="from stdin\n",
    )
    assert (proc.returncode, proc.stdout) == (0, "you\nfrom stdin\n")


def test_run_streams_output_while_the_command_runs(tmp_path):
    flag = tmp_path / "go"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hermes_env_core.cli",
            "run",
            f"echo ready; until [ -e {flag} ]; do sleep 0.02; done; echo done",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=clean_env(),
    )
    try:
        assert _read_until(proc.stdout.fileno(), b"ready\n").endswith(b"ready\n")  # before the command can finish
        assert proc.poll() is None
        flag.touch()
        assert proc.wait(WAIT) == 0
        assert proc.stdout.read() == b"done\n"
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_cancels_the_command_with_130(tmp_path):
    pidfile = tmp_path / "pid"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hermes_env_core.cli",
            "run",
            f"echo $$ > {pidfile}; echo ready; sleep 60; echo finished",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=clean_env(),
    )
    try:
        _read_until(proc.stdout.fileno(), b"ready\n")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT) == 130
        assert b"finished" not in proc.stdout.read()
        assert b"Traceback" not in proc.stderr.read()
        with pytest.raises(ProcessLookupError):
            os.kill(int(pidfile.read_text()), 0)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def core_registry(monkeypatch):
    """Only the core's backends, whatever else is installed here."""
    registry = BackendRegistry(entry_points=False)
    registry.register(builtin, name="core", distribution="hermes-env-core")
    monkeypatch.setattr(cli_module, "get_registry", lambda: registry)
    monkeypatch.setattr(factory_module, "get_registry", lambda: registry)
    return registry


@pytest.mark.parametrize(
    "args, needle",
    [
        (("run", "--env", "dokcer", "true"), "did you mean 'docker'?"),
        (("run", "--env", "modal", "true"), "pip install ./plugins/hermes-env-modal"),
        (("run", "--option", "timeout=soon", "true"), "from --option timeout"),
        (("run", "--option", "colour=blue", "true"), "unknown option 'colour'"),
        (("config", "--env", "apptainer"), "pip install ./plugins/hermes-env-singularity"),
    ],
)
def test_errors_are_one_line_with_exit_status_2(core_registry, args, needle):
    code, out, err = run_main(*args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hermes-env: error: ") and needle in lines[0], err


def test_errors_in_a_subprocess_have_no_traceback():
    proc = cli("run", "--env", "dokcer", "true")
    assert proc.returncode == 2
    assert proc.stderr.startswith("hermes-env: error: unknown backend 'dokcer'") and "Traceback" not in proc.stderr


def test_a_bad_config_file_is_a_one_line_error(tmp_path):
    (tmp_path / "hermes-env.toml").write_text("[terminal.local]\ntimeot = 1\n")
    proc = cli("run", "true")
    assert proc.returncode == 2 and "timeot" in proc.stderr and str(tmp_path / "hermes-env.toml") in proc.stderr


def test_usage_errors_exit_2():
    assert cli("run").returncode == 2
    assert cli("run", "--timeout", "0", "true").returncode == 2
    assert cli().returncode == 2


# -- shell -----------------------------------------------------------------------------------


def test_shell_over_stdin_keeps_state_and_exits_at_eof_with_the_last_status(tmp_path):
    script = f'cd {tmp_path}\nexport X=5\nf() {{ echo "f:$1"; }}\necho "$X $PWD"\nf arg\nfalse\n'
    proc = cli("shell", input=script)
    assert proc.stdout == f"5 {tmp_path}\nf:arg\n"
    assert proc.returncode == 1


def test_shell_exit_leaves_with_its_status_and_cwd_option(tmp_path):
    proc = cli("shell", "--cwd", str(tmp_path), input="pwd\nexit 4\necho never\n")
    assert (proc.returncode, proc.stdout) == (4, f"{tmp_path}\n")


def test_shell_line_continuation():
    proc = cli("shell", input="echo one \\\n two\n")
    assert proc.stdout == "one two\n"


def _read_until(
    fd: int, needle: bytes | re.Pattern[bytes], timeout: float = WAIT, buf: bytearray | None = None
) -> bytes:
    """Read from ``fd`` until ``needle`` has arrived; returns everything read."""
    data = bytearray() if buf is None else buf
    deadline = time.monotonic() + timeout
    while True:
        found = needle.search(data) if isinstance(needle, re.Pattern) else needle in data
        if found:
            return bytes(data)
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {needle!r}; got {bytes(data)!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                raise AssertionError(f"EOF while waiting for {needle!r}; got {bytes(data)!r}")
            data += chunk


PROMPT = re.compile(rb"\(local\) [^\r\n]*\$ $")


def test_shell_in_a_terminal_ctrl_c_cancels_the_command_not_the_shell(tmp_path):
    # Everything the child needs is computed before fork: this process has
    # threads, and the child may only call async-signal-safe functions.
    argv = [sys.executable, "-m", "hermes_env_core.cli", "shell"]
    env = clean_env(TERM="dumb", INPUTRC="/dev/null", XDG_STATE_HOME=str(tmp_path))
    where = str(tmp_path)
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI with the pty as its controlling terminal
        try:
            os.chdir(where)
            os.execve(sys.executable, argv, env)
        finally:
            os._exit(127)
    try:
        _read_until(fd, PROMPT)
        os.write(fd, b"export KEEP=kept; cd /\n")
        out = _read_until(fd, re.compile(rb"\(local\) /\$ $"))
        # quotes make the output differ from the terminal's echo of the line
        os.write(fd, b'echo "sta""rted"; sleep 60; echo "fin""ished"\n')
        _read_until(fd, b"started")
        started = time.monotonic()
        os.write(fd, b"\x03")  # the terminal turns this into SIGINT for the foreground process group
        out = _read_until(fd, PROMPT, buf=bytearray())
        assert time.monotonic() - started < 15
        assert b"finished" not in out
        os.write(fd, b'echo "$KEEP:$PWD"\n')
        out = _read_until(fd, PROMPT, buf=bytearray())
        assert b"kept:/" in out
        os.write(fd, b"\x03")  # at the prompt: discards the line, the shell stays
        _read_until(fd, PROMPT, buf=bytearray())
        os.write(fd, b'echo "ali""ve"\n')
        assert b"alive" in _read_until(fd, PROMPT, buf=bytearray())
        os.write(fd, b"\x04")  # EOF
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        pid = 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


# -- backends, config, doctor -----------------------------------------------------------------


def test_backends_lists_the_builtins_with_distribution_and_version():
    proc = cli("backends")
    assert proc.returncode == 0
    version = importlib_metadata.version("hermes-env-core")
    [local] = [line for line in proc.stdout.splitlines() if line.startswith("local ")]
    assert local.split() == ["local", "-", "hermes-env-core", version, API_VERSION, "loadable"]
    assert proc.stdout.splitlines()[0].split() == ["NAME", "ALIASES", "DISTRIBUTION", "VERSION", "API", "STATUS"]


def test_backends_json():
    data = json.loads(cli("backends", "--json").stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert {"local", "docker", "ssh"} <= set(rows)
    assert rows["local"]["loadable"] is True and rows["local"]["distribution"] == "hermes-env-core"
    assert rows["docker"]["target"] == "hermes_env_core.backends.docker:DockerEnvironment"
    assert set(data) == {"api_version", "backends", "failed_plugins", "conflicts", "not_installed"}
    assert data["api_version"] == API_VERSION == rows["local"]["api_version"]


def test_backends_names_what_to_install_for_known_backends(core_registry):
    code, out, _ = run_main("backends")
    assert code == 0
    assert "  modal: pip install ./plugins/hermes-env-modal in a hermes-env checkout; hermes-env-modal is not on PyPI yet" in out.splitlines()
    assert "  singularity (apptainer): pip install ./plugins/hermes-env-singularity in a hermes-env checkout; hermes-env-singularity is not on PyPI yet" in out.splitlines()


def test_config_shows_each_value_and_its_source(tmp_path):
    path = tmp_path / "conf.toml"
    path.write_text('[terminal]\nkill_grace_s = 2.5\n[terminal.local]\nbash = "bash"\n')
    proc = cli("config", "--config-file", str(path), "-o", "cwd=/srv", TERMINAL_TIMEOUT="7")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split("=")[0].strip(): line for line in proc.stdout.splitlines()}
    assert lines["backend"].endswith("(default)")
    assert lines["timeout"].split() == ["timeout", "=", "7.0", "environment", "variable", "TERMINAL_TIMEOUT"]
    assert lines["kill_grace_s"].split()[-2:] == [str(path), "[terminal]"]
    assert lines["bash"].split()[-2:] == [str(path), "[terminal.local]"]
    assert lines["cwd"].split()[-2:] == ["--option", "cwd"]
    assert lines["max_output_bytes"].split()[-1] == "default"
    data = json.loads(cli("config", "--json", "--env", "local", TERMINAL_TIMEOUT="7").stdout)
    assert data["backend"] == {"value": "local", "source": "argument"}
    assert data["options"]["timeout"] == {"value": 7.0, "source": "environment variable TERMINAL_TIMEOUT"}


def test_config_masks_secret_looking_values():
    data = json.loads(cli("config", "--json", "-o", 'env={"MY_TOKEN": "s3cret", "PLAIN": "x"}').stdout)
    assert data["options"]["env"]["value"] == {"MY_TOKEN": "********", "PLAIN": "x"}


class _Checked(LocalEnvironment):
    name = "checked"

    @classmethod
    def check_requirements(cls) -> list[str]:
        return ["the frobnicator binary is missing: apt-get install frobnicator"]


class _Plugin:
    @hookimpl
    def hermes_env_backends(self):
        return [
            BackendSpec(name="checked", target=f"{__name__}:_Checked"),
            BackendSpec(name="needsdk", target="hermes_env_needs_missing_sdk:C", install_hint="pip install needsdk"),
        ]


@pytest.fixture
def doctor_registry(monkeypatch, tmp_path):
    (tmp_path / "hermes_env_needs_missing_sdk.py").write_text("import an_sdk_that_is_not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = BackendRegistry(entry_points=False)
    registry.register(builtin, name="core", distribution="hermes-env-core")
    registry.register(_Plugin(), name="doc", distribution="doc-dist")
    monkeypatch.setattr(cli_module, "get_registry", lambda: registry)
    return registry


def test_doctor_reports_problems_and_what_to_install(doctor_registry):
    code, out, _ = run_main("doctor")
    assert code == 1
    assert "local: ok" in out.splitlines()
    assert "checked: 1 problem(s)" in out and "apt-get install frobnicator" in out
    [needsdk] = [line for line in out.splitlines() if line.startswith("needsdk:")]
    assert "FAIL" in needsdk and "an_sdk_that_is_not_installed_xyz" in needsdk and "pip install needsdk" in needsdk
    assert "modal: not installed (pip install ./plugins/hermes-env-modal " in out


def test_doctor_for_one_healthy_backend_exits_0(doctor_registry):
    assert run_main("doctor", "local") == (
        0, "local: ok\n  commands: session server (one bash in the target holds the session)\n", ""
    )


def test_doctor_for_an_unknown_name():
    proc = cli("doctor", "locl")
    assert proc.returncode == 1 and "did you mean 'local'?" in proc.stdout


def test_sync_progress_bar_draws_large_pushes_only():
    import io
    from types import SimpleNamespace

    from hermes_env_core.cli import SyncProgressBar

    out = io.StringIO()
    bar = SyncProgressBar(out, width=10)
    bar(SimpleNamespace(phase="push", files_done=1, files_total=2, bytes_done=10, bytes_total=100))
    assert out.getvalue() == ""  # small: not worth a bar
    big = 8 * 1024 * 1024
    bar(SimpleNamespace(phase="push", files_done=1, files_total=2, bytes_done=big // 2, bytes_total=big))
    bar(SimpleNamespace(phase="push", files_done=2, files_total=2, bytes_done=big, bytes_total=big))
    text = out.getvalue()
    assert "[#####-----]  50% 1/2 files" in text
    assert text.endswith("[##########] 100% 2/2 files 8.4/8.4 MB\n")
