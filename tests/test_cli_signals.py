"""SIGTERM, SIGHUP and SIGINT sent to ``hermes-env run`` / ``shell`` end the command's whole tree and clean up.

Driven as a supervisor or ``timeout`` would: the console script in a real
process, a real ``sleep`` found with psutil, a real signal; then nothing of the
command's tree may be left, nor a cgroup directory, nor (docker) the container.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from hermes_env_core.testing import wait_until

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")
WAIT = 60.0  # an upper bound for events that come at once on a quiet machine
SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}


def _start(tmp_path: Path, *args: str, stdin: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [HERMES_ENV, *args], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path
    )


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _sleep_in_tree(pid: int, marker: str) -> list[psutil.Process] | None:
    """The CLI's process tree once the command's ``sleep <marker>`` runs in it, else None."""
    tree = _descendants(pid)
    for p in tree:
        try:
            if p.cmdline() == ["sleep", marker]:
                return tree
        except psutil.Error:
            continue
    return None


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cgroup_dirs_of(pid: int) -> list[str]:
    """Cgroup directories named after ``pid`` (hermes-env-<pid>-…) in every hierarchy this process is in."""
    found = []
    with open("/proc/self/cgroup", encoding="ascii") as f:
        lines = f.read().splitlines()
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            roots = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        elif controllers.startswith("name="):
            continue
        else:
            roots = [os.path.join("/sys/fs/cgroup", controllers)]
        for root in roots:
            base = os.path.join(root, rel.lstrip("/"))
            try:
                names = os.listdir(base)
            except OSError:
                continue
            found += [os.path.join(base, n) for n in names if n.startswith(f"hermes-env-{pid}-")]
    return sorted(set(found))


def _marker() -> str:
    # a duration nobody else sleeps, so the test finds this command's sleep and no other
    return f"{1000 + uuid.uuid4().int % 100000}.5"


def _stop_and_check(proc: subprocess.Popen[bytes], marker: str, sig: signal.Signals) -> None:
    tree: list[psutil.Process] = []
    try:
        assert wait_until(lambda: tree.extend(_sleep_in_tree(proc.pid, marker) or []) or bool(tree), WAIT)
        assert proc.poll() is None
        proc.send_signal(sig)
        assert proc.wait(WAIT) == 128 + sig
        left = [p.pid for p in tree if _alive(p)]
        assert not left, f"processes of the command's tree outlived {sig.name}: {left}"
        assert _cgroup_dirs_of(proc.pid) == []
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert "Traceback" not in err and f"stopped by {sig.name}" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in tree:
            if _alive(p):
                p.kill()


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_run_stopped_by_a_signal_ends_the_tree_and_exits_128_plus_it(tmp_path, sig):
    marker = _marker()
    # a child of a child: the whole tree must go, not only the command's bash
    proc = _start(tmp_path, "run", f"bash -c 'sleep {marker}; echo after'; echo finished")
    _stop_and_check(proc, marker, sig)
    assert b"finished" not in (proc.stdout.read() if proc.stdout else b"")


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_shell_stopped_by_a_signal_ends_the_running_command(tmp_path, sig):
    marker = _marker()
    proc = _start(tmp_path, "shell", stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(f"echo one\nsleep {marker}\necho never\n".encode())
    proc.stdin.flush()  # stdin stays open: the shell would go on reading
    try:
        _stop_and_check(proc, marker, sig)
        assert proc.stdout is not None and proc.stdout.read() == b"one\n"
    finally:
        proc.stdin.close()


def test_shell_waiting_for_input_stops_at_sigterm_with_143(tmp_path):
    proc = _start(tmp_path, "shell", stdin=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b"echo ready\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"ready\n"  # the session is up; the shell now waits on stdin
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 143
        assert _cgroup_dirs_of(proc.pid) == []
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_timeout_in_front_of_run_leaves_nothing_behind(tmp_path):
    # The issue's own reproduction: `timeout 2 hermes-env run 'sleep 100'`.
    marker = _marker()
    proc = subprocess.Popen(
        ["timeout", "5", HERMES_ENV, "run", f"sleep {marker}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path,
    )
    cli: list[psutil.Process] = []
    try:
        assert wait_until(lambda: cli.extend(_descendants(proc.pid)[:1]) or bool(cli), WAIT)
        assert proc.wait(WAIT) == 124
        assert _sleeps_anywhere(marker) == [], "the command outlived the CLI (re-parented)"
        assert _cgroup_dirs_of(cli[0].pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _sleeps_anywhere(marker):
            p.kill()


def _sleeps_anywhere(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] == ["sleep", marker] and _alive(p):
            found.append(p)
    return found


# -- docker ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> str:
    from tests.support.docker_engine import ensure_engine, ensure_test_image

    return ensure_test_image(ensure_engine())


def _containers_of(pid: int) -> list[object]:
    from tests.support.docker_engine import ensure_engine

    # sparse: no inspect per container (one removed between the list and its inspect would raise)
    return ensure_engine().containers.list(all=True, sparse=True, filters={"label": f"hermes-env.owner-pid={pid}"})


def _sleeps_in(container: object, marker: str) -> bool:
    try:
        top = container.top()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not started yet
        return False
    return any(row and row[-1] == f"sleep {marker}" for row in top.get("Processes") or [])


@pytest.mark.docker
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_docker_run_stopped_by_a_signal_removes_its_container(tmp_path, image, sig):
    marker = _marker()
    proc = _start(tmp_path, "run", "--env", "docker", "-o", f"image={image}", f"sleep {marker}")
    try:
        assert wait_until(lambda: any(_sleeps_in(c, marker) for c in _containers_of(proc.pid)), 90)
        [container] = _containers_of(proc.pid)
        proc.send_signal(sig)
        assert proc.wait(WAIT) == 128 + sig
        assert _containers_of(proc.pid) == [], "the container outlived the CLI"
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in _containers_of(proc.pid):
            c.remove(force=True)  # type: ignore[attr-defined]


@pytest.mark.docker
def test_docker_persistent_container_stays_but_the_command_is_stopped(tmp_path, image):
    marker = _marker()
    task = f"sig-{uuid.uuid4().hex[:8]}"
    proc = _start(
        tmp_path, "run", "--env", "docker", "-o", f"image={image}", "-o", "persistent=true", "-o", f"task_id={task}",
        f"sleep {marker}",
    )
    from tests.support.docker_engine import ensure_engine

    client = ensure_engine()

    def mine() -> list[object]:
        # sparse: no inspect per container (one removed between the list and its inspect would raise)
        return client.containers.list(all=True, sparse=True, filters={"label": f"hermes-env.task-id={task}"})

    try:
        started = wait_until(lambda: proc.poll() is not None or any(_sleeps_in(c, marker) for c in mine()), 90)
        assert started and proc.poll() is None, proc.stderr.read().decode(errors="replace") if proc.poll() is not None else "no sleep"
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(WAIT) == 129
        [container] = mine()
        container.reload()  # type: ignore[attr-defined]
        assert container.status == "running"  # type: ignore[attr-defined]
        assert not _sleeps_in(container, marker), "the command outlived the CLI in a kept container"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in mine():
            c.remove(force=True)  # type: ignore[attr-defined]


@pytest.mark.docker
def test_docker_signal_while_the_container_starts_leaves_no_container(tmp_path, image):
    # The signal comes while the environment is being made: it waits for that to finish, then all is undone.
    proc = _start(tmp_path, "run", "--env", "docker", "-o", f"image={image}", "sleep 100")
    try:
        assert wait_until(lambda: bool(_containers_of(proc.pid)) or proc.poll() is not None, 90)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 143
        assert _containers_of(proc.pid) == [], "the container outlived the CLI"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in _containers_of(proc.pid):
            c.remove(force=True)  # type: ignore[attr-defined]


# -- an interactive shell in a terminal ------------------------------------------------------------


def _shell_in_a_terminal(tmp_path: Path) -> tuple[int, int]:
    import pty

    argv = [HERMES_ENV, "shell"]
    env = {**_env(), "TERM": "dumb", "INPUTRC": "/dev/null", "XDG_STATE_HOME": str(tmp_path)}
    where = str(tmp_path)
    pid, fd = pty.fork()
    if pid == 0:  # only async-signal-safe calls here: this process has threads
        try:
            os.chdir(where)
            os.execve(HERMES_ENV, argv, env)
        finally:
            os._exit(127)
    return pid, fd


def _read_until_prompt(fd: int) -> bytes:
    import re
    import select
    import time

    prompt = re.compile(rb"\(local\) [^\r\n]*\$ $")
    data = bytearray()
    deadline = time.monotonic() + WAIT
    while not prompt.search(data):
        left = deadline - time.monotonic()
        assert left > 0, f"no prompt; got {bytes(data)!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"EOF before the prompt; got {bytes(data)!r}"
            data += chunk
    return bytes(data)


def _wait_status(pid: int, timeout: float) -> int | None:
    """The exit status of child ``pid`` once it ends (None if it has not after ``timeout``)."""
    status: list[int] = []

    def ended() -> bool:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            status.append(os.waitstatus_to_exitcode(raw))
        return bool(status)

    wait_until(ended, timeout)
    return status[0] if status else None


@pytest.mark.parametrize("when", ["running", "at the prompt"])
def test_a_closed_terminal_sighup_ends_the_interactive_shell_and_its_command(tmp_path, when):
    marker = _marker()
    pid, fd = _shell_in_a_terminal(tmp_path)
    tree: list[psutil.Process] = []
    status: int | None = None
    try:
        _read_until_prompt(fd)
        if when == "running":
            os.write(fd, f"sleep {marker}\n".encode())
            assert wait_until(lambda: tree.extend(_sleep_in_tree(pid, marker) or []) or bool(tree), WAIT)
        os.kill(pid, signal.SIGHUP)
        status = _wait_status(pid, WAIT)
        assert status == 129
        assert not [p.pid for p in tree if _alive(p)], "the command outlived the shell's terminal"
        assert _cgroup_dirs_of(pid) == []
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
        for p in tree:
            if _alive(p):
                p.kill()


def test_cgroups_of_a_cli_killed_outright_are_removed_by_the_next_one(tmp_path):
    # SIGKILL cannot be caught: what the killed CLI made is swept by the next hermes-env that starts.
    marker = _marker()
    proc = _start(tmp_path, "run", f"sleep {marker}")
    tree: list[psutil.Process] = []
    try:
        assert wait_until(lambda: tree.extend(_sleep_in_tree(proc.pid, marker) or []) or bool(tree), WAIT)
        left = _cgroup_dirs_of(proc.pid)
        if not left:
            pytest.skip("no cgroup can be made for local commands here")
        proc.kill()
        proc.wait()
        for p in tree:  # the orphaned command: a cgroup with a process in it is never removed
            if _alive(p):
                p.kill()
        assert wait_until(lambda: not any(_alive(p) for p in tree), WAIT)
        assert _cgroup_dirs_of(proc.pid) == left
        after = subprocess.run([HERMES_ENV, "run", "true"], env=_env(), cwd=tmp_path, timeout=WAIT * 2)
        assert after.returncode == 0
        assert _cgroup_dirs_of(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in tree:
            if _alive(p):
                p.kill()


def test_the_prompts_sigint_watcher_passes_every_signal_on_to_the_guards_watcher():
    """Python keeps one wakeup fd. At the prompt the shell's Ctrl-C watcher holds it; the
    signal guard's watcher (which re-sends a SIGTERM or SIGHUP that readline's select
    missed) must still see those signals, or a closed terminal waits for a key."""
    import threading

    from hermes_env_core.cli.shell import _prompt_interrupts
    from hermes_env_core.cli.signals import SignalGuard

    guard = SignalGuard(keyboard_interrupt=True)
    handled = threading.Event()
    previous = signal.signal(signal.SIGHUP, lambda *_: handled.set())
    try:
        guard._start_watcher()  # the guard's wakeup fd, as install() makes it
        nudged: list[int] = []
        guard._nudge = lambda signum, main, seen: nudged.append(signum)  # type: ignore[method-assign]
        with _prompt_interrupts(True) as nudge:
            assert nudge is not None
            signal.raise_signal(signal.SIGHUP)
            assert handled.is_set()
            assert wait_until(lambda: nudged == [signal.SIGHUP], WAIT)
    finally:
        guard.uninstall()
        signal.signal(signal.SIGHUP, previous)
