"""The public ``Target`` interface: ``TargetEnvironment`` over a real target on this machine.

The target here is a directory of this machine ("the box"): removing it is
losing the target, ``recover`` makes a new one. Commands run for real through
``start_bash``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import pytest

import hermes_env_core
from hermes_env_core import (
    API_VERSION,
    EnvironmentConfig,
    EnvironmentUnavailable,
    ProcessHandle,
    RunRequest,
    Target,
    TargetEnvironment,
    TargetLostError,
    run_to_end,
)
from hermes_env_core.backends.local import start_bash
from hermes_env_core.environment.target import parse_api_version
from hermes_env_core.errors import EnvironmentClosedError
from hermes_env_core.testing import EnvironmentConformance, wait_until


class BoxConfig(EnvironmentConfig):
    recoverable: bool = True


class BoxTarget(Target):
    def __init__(self, recoverable: bool) -> None:
        self.recoverable = recoverable
        self.box = tempfile.mkdtemp(prefix="hermes-t-box-")
        self.private = tempfile.mkdtemp(prefix="hermes-t-box-state-")
        self.recovered: list[str] = []
        self.released = 0
        self.before_loss: threading.Barrier | None = None  # lets concurrent starts fail together

    def start(self, request: RunRequest) -> ProcessHandle:
        if not os.path.isdir(self.box):
            if self.before_loss is not None:
                self.before_loss.wait(30)
            raise TargetLostError(f"box {self.box} is gone")
        return start_bash(request, cwd=self.box)

    def state_dir(self) -> str:
        return self.private

    def recover(self, why: str) -> bool:
        self.recovered.append(why)
        if not self.recoverable:
            return False
        os.mkdir(self.box, 0o700)
        return True

    def release(self) -> None:
        self.released += 1
        shutil.rmtree(self.box, ignore_errors=True)
        shutil.rmtree(self.private, ignore_errors=True)


class BoxEnvironment(TargetEnvironment[BoxConfig]):
    name = "box"
    config_model = BoxConfig

    def make_target(self, config: BoxConfig) -> BoxTarget:
        return BoxTarget(config.recoverable)

    @property
    def box(self) -> BoxTarget:
        target = self.target
        assert isinstance(target, BoxTarget)
        return target


class TestTargetConformance(EnvironmentConformance):
    @pytest.fixture
    def environment(self):
        with BoxEnvironment(timeout=60) as env:
            yield env


def test_public_names_exported():
    for name in ("API_VERSION", "RunRequest", "Target", "TargetEnvironment", "TargetLostError", "run_to_end"):
        assert name in hermes_env_core.__all__ and getattr(hermes_env_core, name) is not None
    assert parse_api_version(API_VERSION)[0] >= 1


@pytest.mark.parametrize("bad", ["1", "1.", ".1", "v1.0", "1.0.0", "one.two", "1.x", "", "１.0"])
def test_parse_api_version_rejects_naming_the_value(bad):
    with pytest.raises(ValueError, match="MAJOR.MINOR") as info:
        parse_api_version(bad)
    assert repr(bad) in str(info.value)


def test_parse_api_version():
    assert parse_api_version("1.0") == (1, 0)
    assert parse_api_version("12.34") == (12, 34)


def test_config_is_the_backends_own_model():
    with BoxEnvironment(recoverable=False) as env:
        assert isinstance(env.config, BoxConfig) and env.config.recoverable is False


def test_lost_target_is_recovered_once_and_the_session_kept():
    with BoxEnvironment() as env:
        env.execute("export HERMES_T_KEEP=yes; cd /tmp")
        box = env.box
        shutil.rmtree(box.box)
        r = env.execute('echo "$HERMES_T_KEEP"; pwd')
        assert r.output == "yes\n/tmp\n" and r.exit_code == 0
        assert box.recovered == [f"box {box.box} is gone"]
        assert any("recreated" in n and box.box in n for n in r.notes), r.notes
        assert env.execute("echo again").notes == ()


def test_unrecoverable_target_raises_naming_why():
    with BoxEnvironment(recoverable=False) as env:
        env.execute("true")
        shutil.rmtree(env.box.box)
        with pytest.raises(EnvironmentUnavailable, match="is gone; it could not be brought back"):
            env.execute("true")


def test_concurrent_commands_losing_the_target_recover_it_once():
    n = 4
    with BoxEnvironment() as env:
        env.execute("true")
        box = env.box
        box.before_loss = threading.Barrier(n)
        shutil.rmtree(box.box)
        results: list[object] = []

        def run() -> None:
            try:
                results.append(env.execute("echo ok").output)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                results.append(exc)

        threads = [threading.Thread(target=run) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == ["ok\n"] * n
        assert len(box.recovered) == 1


def test_release_once_and_no_target_after_close():
    env = BoxEnvironment()
    env.execute("true")
    box = env.box
    env.close()
    env.close()
    assert box.released == 1 and not os.path.exists(box.box)
    with pytest.raises(EnvironmentClosedError):
        env.target


def test_closing_an_unused_environment_makes_no_target():
    class Counting(BoxEnvironment):
        made = 0

        def make_target(self, config: BoxConfig) -> BoxTarget:
            type(self).made += 1
            return super().make_target(config)

    Counting().close()
    assert Counting.made == 0


def test_make_target_returning_a_non_target_names_what_is_missing():
    class Half:
        def start(self, request: RunRequest) -> ProcessHandle:
            return start_bash(request)

    class Broken(TargetEnvironment[EnvironmentConfig]):
        name = "broken"

        def make_target(self, config: EnvironmentConfig) -> Target:
            return Half()  # type: ignore[return-value]

    with Broken() as env, pytest.raises(TypeError, match="Broken.make_target .* not a Target .*run_helper, state_dir"):
        env.execute("true")


def test_run_helper_default_runs_outside_the_session():
    with BoxEnvironment() as env:
        env.execute("export HERMES_T_SESSION=1")
        code, out = env.run_helper('echo "${HERMES_T_SESSION-none}"; echo err >&2; exit 3', timeout=30)
        assert (code, out) == (3, b"none\nerr\n")
        assert env.execute('echo "$HERMES_T_SESSION"').output == "1\n"


def test_run_helper_timeout_kills_its_tree(tmp_path):
    pidfile = tmp_path / "pid"
    started = time.monotonic()
    with BoxEnvironment() as env, pytest.raises(TimeoutError, match="after 0.5s"):
        env.run_helper(f"setsid sleep 300 & echo $! >{pidfile}; sleep 300", timeout=0.5)
    assert time.monotonic() - started < 10
    pid = int(pidfile.read_text())
    assert wait_until(lambda: not _alive(pid), 10), f"helper's child {pid} survived"


def test_run_to_end_returns_whole_output_and_code():
    code, out = run_to_end(start_bash(RunRequest("head -c 300000 /dev/zero | tr '\\0' x; exit 5")), timeout=30)
    assert code == 5 and out == b"x" * 300000


def test_start_bash_long_script_stdin_and_login(tmp_path):
    long = "true\n" * 30000 + "cat; echo $0"  # past one argv string's limit
    code, out = run_to_end(start_bash(RunRequest(long, stdin=b"in\n"), cwd=str(tmp_path)), timeout=30)
    assert (code, out) == (0, b"in\nbash\n")
    code, out = run_to_end(start_bash(RunRequest("shopt -q login_shell && echo login", login=True)), timeout=30)
    assert out.endswith(b"login\n")


def test_start_bash_filters_secrets_by_default(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("HERMES_T_PLAIN", "plain")
    _, out = run_to_end(start_bash(RunRequest('echo "${OPENAI_API_KEY-no} $HERMES_T_PLAIN"')), timeout=30)
    assert out == b"no plain\n"
    _, out = run_to_end(start_bash(RunRequest('echo "${OPENAI_API_KEY-no}"'), env={"OPENAI_API_KEY": "x"}), timeout=30)
    assert out == b"x\n"


def test_start_bash_kill_reaches_setsid_children(tmp_path):
    pidfile = tmp_path / "pid"
    handle = start_bash(RunRequest(f"setsid sleep 300 & echo $! >{pidfile}; echo up; sleep 300"))
    assert handle.stdout is not None and handle.stdout.readline() == b"up\n"
    pid = int(pidfile.read_text())
    assert getattr(handle, "tree_alive")() is True
    handle.kill()
    handle.wait(timeout=10)
    assert wait_until(lambda: not _alive(pid), 10), f"setsid child {pid} survived the kill"
    assert getattr(handle, "tree_alive")() is False
    handle.stdout.close()


def test_start_bash_missing_bash_is_unavailable_naming_it():
    with pytest.raises(EnvironmentUnavailable, match="cannot start /no/such/bash"):
        start_bash(RunRequest("true"), bash="/no/such/bash")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
