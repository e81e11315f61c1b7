"""Background programs on a PTY that wait for their user: one ``waiting_for_input`` per wait."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.processes import NotificationKind, ProcessRegistry
from hermes_env_core.processes.inputwait import reading_terminal, tty_of
from hermes_env_core.testing import wait_until
from tests.processes.bgsupport import make_registry
from tests.processes.suite import take

WAIT = NotificationKind.WAITING_FOR_INPUT


@pytest.fixture
def env() -> Iterator[LocalEnvironment]:
    e = LocalEnvironment(timeout=60)
    yield e
    e.close()


@pytest.fixture
def registry() -> Iterator[ProcessRegistry]:
    reg = make_registry(input_wait_s=0.3)
    yield reg
    reg.close()


def _waits(proc: object) -> list[str]:
    return [n.text for n in proc.notifications if n.kind is WAIT]  # type: ignore[attr-defined]


def test_read_prompt_is_reported_once_and_cleared_by_input(env: LocalEnvironment, registry: ProcessRegistry) -> None:
    proc = registry.spawn(env, "read -p 'name? ' x; echo \"got $x\"; read -p 'again? ' y; echo \"and $y\"", pty=True)
    note = take(registry, WAIT, proc)
    assert note.text == "name? "
    assert proc.waiting_for_input and proc.info().waiting_for_input
    proc.submit("bob")
    assert not proc.waiting_for_input
    second = take(registry, WAIT, proc)
    assert second.text == "again? "
    assert "got bob" in proc.output
    proc.submit("ann")
    assert proc.wait(15) == 0
    assert "and ann" in proc.output
    assert _waits(proc) == ["name? ", "again? "]  # once per wait, never repeated while it waits
    assert not proc.info().waiting_for_input


def test_python_repl_prompt(env: LocalEnvironment, registry: ProcessRegistry) -> None:
    proc = registry.spawn(env, f"{sys.executable} -q -i", pty=True)
    note = take(registry, WAIT, proc)
    assert note.text == ">>> "
    proc.submit("print(6 * 7)")
    take(registry, WAIT, proc)
    assert "42" in proc.output
    proc.submit("raise SystemExit(3)")
    assert proc.wait(15) == 3
    assert len(_waits(proc)) == 2


def test_silent_sleep_and_busy_loop_are_not_waiting(env: LocalEnvironment, registry: ProcessRegistry) -> None:
    # Both stay silent for several times input_wait_s, then end by themselves.
    sleeper = registry.spawn(env, "sleep 1.5; echo slept", pty=True)
    busy = registry.spawn(
        env, f"{sys.executable} -c 'import time; t = time.time()\nwhile time.time() - t < 1.5: pass'", pty=True
    )
    assert sleeper.wait(15) == 0 and busy.wait(15) == 0
    assert _waits(sleeper) == [] and _waits(busy) == []


def test_reading_terminal_sees_a_read_of_stdin_only(env: LocalEnvironment, registry: ProcessRegistry) -> None:
    proc = registry.spawn(env, "exec cat", pty=True)  # cat blocks in read(0) at once
    assert proc.pid is not None
    tty = tty_of(proc.pid)
    assert tty is not None and tty.startswith("/dev/pts/")
    wait_until(lambda: reading_terminal(proc.pid or 0, tty), timeout=10)
    assert not reading_terminal(proc.pid or 0, "/dev/pts/999999")
    proc.kill()


def test_pipe_processes_are_never_reported(env: LocalEnvironment, registry: ProcessRegistry) -> None:
    proc = registry.spawn(env, "read x; echo \"got $x\"")
    proc.submit("hi")
    assert proc.wait(15) == 0
    assert _waits(proc) == []


def test_input_wait_must_be_positive() -> None:
    with pytest.raises(ValueError, match="input_wait_s"):
        ProcessRegistry(input_wait_s=0)


# -- in a target: the detached path (followed by polls) on local, docker and ssh --------


@pytest.fixture(params=["local", "docker", "ssh"])
def target(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[tuple[object, bool]]:
    """(environment, detached) for each target whose processes are followed by polls in it."""
    if request.param == "local":
        yield LocalEnvironment(timeout=60), True
        return
    if request.param == "docker":
        from tests.processes.bgsupport import docker_env

        with docker_env() as env:
            assert env.execute("command -v script").exit_code == 0, "the test image must have script(1)"
            yield env, False
        return
    from tests.processes.bgsupport import ssh_env

    with ssh_env(request.getfixturevalue("sshd_server"), tmp_path) as env:
        yield env, False


def test_prompt_in_a_target_once_per_wait(target: tuple[object, bool], registry: ProcessRegistry) -> None:
    env, detached = target
    proc = registry.spawn(
        env,  # type: ignore[arg-type]
        "sleep 0.8; read -p 'continue? [y/n] ' a; echo \"answer=$a\"",
        pty=True,
        detached=detached,
    )
    try:
        note = take(registry, WAIT, proc, timeout=30)
        assert note.text == "continue? [y/n] "
        assert proc.info().waiting_for_input
        proc.submit("y")
        assert proc.wait(30) == 0
        assert "answer=y" in proc.output
        assert _waits(proc) == ["continue? [y/n] "]  # the silent sleep before it gave none
    finally:
        if proc.running:
            proc.kill()
