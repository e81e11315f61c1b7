"""create_environment() and EnvironmentPool: get-or-create, idle reaping, closing at exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hermes_env_core import (
    BackendNotFoundError,
    BackendRegistry,
    BackendSpec,
    ConfigError,
    EnvironmentClosedError,
    EnvironmentFactory,
    EnvironmentPool,
    PluginLoadError,
    create_environment,
    hookimpl,
)
from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.plugins import builtin

WAIT = 10.0  # generous upper bound for an event that should come at once


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(("TERMINAL_", "HERMES_ENV_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


# -- create_environment ------------------------------------------------------------------


def test_the_default_is_a_working_local_environment():
    with create_environment() as env:
        assert isinstance(env, LocalEnvironment)
        assert env.execute("echo hi").output == "hi\n"


def test_options_reach_the_config_and_unknown_ones_are_rejected():
    with create_environment("local", timeout=7, env={"GREETING": "hello"}) as env:
        assert env.config.timeout == 7
        assert env.execute('echo "$GREETING"').output == "hello\n"
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        create_environment("local", colour="blue")


def test_terminal_env_and_terminal_fields_are_read_at_call_time(monkeypatch):
    monkeypatch.setenv("TERMINAL_ENV", "dokcer")
    with pytest.raises(BackendNotFoundError, match="did you mean 'docker'"):
        create_environment()
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv("TERMINAL_TIMEOUT", "9")
    with create_environment() as env:
        assert env.config.timeout == 9
    with create_environment(timeout=3) as env:  # an argument beats the variable
        assert env.config.timeout == 3


def test_the_config_file_in_the_working_directory_is_used(tmp_path):
    (tmp_path / "hermes-env.toml").write_text(
        '[terminal]\nenv = "local"\n[terminal.local]\nenv = {FROM_FILE = "yes"}\n'
    )
    with create_environment() as env:
        assert env.execute('echo "$FROM_FILE"').output == "yes\n"


class _Recorder(LocalEnvironment):
    name = "recorder"
    created: list[_Recorder] = []

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self.closed_event = threading.Event()
        _Recorder.created.append(self)

    def cleanup(self):
        super().cleanup()
        self.closed_event.set()


class _Plugin:
    @hookimpl
    def hermes_env_backends(self):
        return [
            BackendSpec(
                name="recorder",
                target=f"{__name__}:_Recorder",
                aliases=("rec",),
                config_model="hermes_env_core.backends.local:LocalConfig",
            )
        ]


@pytest.fixture
def factory(tmp_path):
    registry = BackendRegistry(entry_points=False)
    registry.register(builtin, name="core", distribution="hermes-env-core")
    registry.register(_Plugin(), name="recorder", distribution="recorder-dist")
    (tmp_path / "none.toml").write_text("")
    return EnvironmentFactory(registry, environ={}, config_file=str(tmp_path / "none.toml"))


def test_a_factory_with_its_own_registry_and_environment(factory, tmp_path):
    (tmp_path / "none.toml").write_text('[terminal]\nenv = "rec"\ntimeout = 4\n')
    env = factory.create()
    try:
        assert type(env) is _Recorder and env.config.timeout == 4
        assert factory.resolve().values["timeout"].source == f"{tmp_path / 'none.toml'} [terminal]"
    finally:
        env.close()
    assert env.closed_event.is_set()


# -- EnvironmentPool ------------------------------------------------------------------------


class FakeEnv:
    """Just what the pool uses; execute() can be held open to look busy."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.closed = False
        self.closed_event = threading.Event()
        self.live = False
        self.asked = threading.Semaphore(0)
        self.running = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def execute(self, command: str, **kw):
        self.running.set()
        assert self.release.wait(WAIT)
        return command

    def _has_live_processes(self) -> bool:
        self.asked.release()
        return self.live

    def close(self) -> None:
        self.closed = True
        self.closed_event.set()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeFactory:
    def __init__(self) -> None:
        self.calls: list[tuple[str | None, dict]] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail: Exception | None = None

    def __call__(self, name, **options):
        with self.lock:
            self.calls.append((name, options))
        self.entered.set()
        assert self.gate.wait(WAIT)
        if self.fail is not None:
            raise self.fail
        return FakeEnv(options["task_id"])


def test_get_creates_once_per_task_and_passes_backend_options_and_task_id():
    fac = FakeFactory()
    with EnvironmentPool("docker", factory=fac, idle_timeout=None, image="x") as pool:
        a = pool.get("a")
        assert pool.get("a") is a
        b = pool.get("b", memory="1g")
        assert b is not a and sorted(pool.task_ids()) == ["a", "b"] and len(pool) == 2 and "a" in pool
    assert fac.calls == [
        ("docker", {"image": "x", "task_id": "a"}),
        ("docker", {"image": "x", "task_id": "b", "memory": "1g"}),
    ]
    assert a.closed and b.closed


def test_concurrent_gets_for_one_task_share_one_creation():
    fac = FakeFactory()
    fac.gate.clear()
    pool = EnvironmentPool(factory=fac, idle_timeout=None)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(pool.get("same"))) for _ in range(8)]
    for t in threads:
        t.start()
    assert fac.entered.wait(WAIT)  # one thread is creating; the others find its creation under way
    fac.gate.set()
    for t in threads:
        t.join(WAIT)
    assert len(fac.calls) == 1 and len(results) == 8 and all(r is results[0] for r in results)
    pool.close_all()


def test_a_failed_creation_reaches_every_waiter_and_the_next_get_retries():
    fac = FakeFactory()
    fac.fail = RuntimeError("engine down")
    pool = EnvironmentPool(factory=fac, idle_timeout=None)
    with pytest.raises(RuntimeError, match="engine down"):
        pool.get("t")
    fac.fail = None
    assert pool.get("t").task_id == "t" and len(fac.calls) == 2
    pool.close_all()


def test_an_environment_closed_behind_the_pools_back_is_replaced():
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=None)
    first = pool.get("t")
    first.close()
    assert pool.get("t") is not first
    assert pool.close("t") and not pool.close("t")
    pool.close_all()


def test_reap_idle_closes_only_what_was_idle_long_enough():
    clock = Clock()
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=60, reap_interval=3600, clock=clock)
    old = pool.get("old")
    clock.now += 50
    fresh = pool.get("fresh")
    clock.now += 15  # old: idle 65 s, fresh: 15 s
    assert pool.reap_idle() == ["old"]
    assert old.closed and not fresh.closed and pool.task_ids() == ["fresh"]
    clock.now += 60
    assert pool.reap_idle() == ["fresh"] and fresh.closed and len(pool) == 0
    pool.close_all()


def test_using_an_environment_keeps_it_alive():
    clock = Clock()
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=60, reap_interval=3600, clock=clock)
    env = pool.get("t")
    clock.now += 59
    env.execute("true")  # through the pool's tracking wrapper
    clock.now += 59
    assert pool.reap_idle() == [] and not env.closed
    clock.now += 1
    assert pool.reap_idle() == ["t"]
    pool.close_all()


def test_a_running_command_is_never_reaped():
    clock = Clock()
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=60, reap_interval=3600, clock=clock)
    env = pool.get("t")
    env.release.clear()
    worker = threading.Thread(target=env.execute, args=("sleep",))
    worker.start()
    assert env.running.wait(WAIT)
    clock.now += 3600
    assert pool.reap_idle() == [] and not env.closed
    env.release.set()
    worker.join(WAIT)
    assert pool.reap_idle() == []  # idle counts from the end of the command
    clock.now += 60
    assert pool.reap_idle() == ["t"]
    pool.close_all()


def test_an_environment_with_live_background_processes_is_never_reaped():
    clock = Clock()
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=60, reap_interval=3600, clock=clock)
    env = pool.get("t")
    env.live = True
    clock.now += 10_000
    assert pool.reap_idle() == [] and not env.closed
    env.live = False
    assert pool.reap_idle() == ["t"] and env.closed
    pool.close_all()


def test_the_background_reaper_closes_idle_environments():
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=0.05, reap_interval=0.01)
    env = pool.get("t")
    assert env.closed_event.wait(WAIT)
    assert "t" not in pool
    pool.close_all()


def test_the_background_reaper_skips_live_environments_until_they_are_done():
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=0.01, reap_interval=0.01)
    env = pool.get("t")
    env.live = True
    for _ in range(3):  # three rounds asked, three times kept
        assert env.asked.acquire(timeout=WAIT)
    assert not env.closed and "t" in pool
    env.live = False
    assert env.closed_event.wait(WAIT)
    pool.close_all()


def test_close_all_stops_the_reaper_and_closes_everything():
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=3600, reap_interval=3600)
    envs = [pool.get(t) for t in "abc"]
    reaper = pool._reaper
    assert reaper is not None and reaper.is_alive()
    pool.close_all()  # must not wait out the hour-long interval
    assert not reaper.is_alive()
    assert all(e.closed for e in envs) and pool.closed
    with pytest.raises(EnvironmentClosedError):
        pool.get("a")


def test_no_reaper_thread_without_an_idle_timeout():
    pool = EnvironmentPool(factory=FakeFactory(), idle_timeout=None)
    pool.get("t")
    assert pool._reaper is None and pool.reap_idle() == []
    pool.close_all()


def test_a_pool_of_real_local_environments(factory):
    pool = EnvironmentPool("recorder", factory=factory, idle_timeout=0.05, reap_interval=0.01)
    env = pool.get("task-1")
    assert isinstance(env, _Recorder) and env.task_id == "task-1"
    assert env.execute("export KEPT=1; echo ok").output == "ok\n"
    assert pool.get("task-1").execute('echo "$KEPT"').output == "1\n"
    assert env.closed_event.wait(WAIT)  # reaped once idle
    assert pool.get("task-1") is not env
    pool.close_all()


def test_everything_is_closed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent("""
        import json
        from hermes_env_core import EnvironmentPool, create_environment
        loose = create_environment("local")
        pool = EnvironmentPool("local", idle_timeout=3600)
        pooled = pool.get("t")
        loose.execute("true"); pooled.execute("true")
        print(json.dumps([loose._state_dir(), pooled._state_dir()]))
        # exits without closing anything
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    dirs = json.loads(proc.stdout)
    assert len(dirs) == 2 and all(d.startswith("/") for d in dirs)
    assert [Path(d).exists() for d in dirs] == [False, False], "cleanup() did not run at exit"


class _NoConfig(LocalEnvironment):
    name = "noconfig"

    def __init__(self) -> None:  # cannot be given its config
        super().__init__()


def test_a_backend_class_that_does_not_take_its_config_is_a_plugin_load_error(factory):
    class Plugin:
        @hookimpl
        def hermes_env_backends(self):
            return [
                BackendSpec(
                    name="noconfig",
                    target=f"{__name__}:_NoConfig",
                    config_model="hermes_env_core.backends.local:LocalConfig",
                )
            ]

    factory.registry.register(Plugin(), distribution="nc")
    with pytest.raises(PluginLoadError, match="does not take its config"):
        factory.create("noconfig")
