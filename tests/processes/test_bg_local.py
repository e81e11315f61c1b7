"""Background processes on this machine: real children on a pipe or PTY, and detached ones."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.factory import EnvironmentPool
from hermes_env_core.processes import (
    NotificationKind,
    ProcessError,
    ProcessRegistry,
    ProcessStatus,
    WatchPattern,
    procinfo,
)
from hermes_env_core.processes.checkpoint import Checkpoint
from hermes_env_core.testing import wait_until
from tests.processes.bgsupport import make_registry
from tests.processes.suite import BackgroundSuite, take


class _Local(BackgroundSuite):
    @pytest.fixture
    def env(self, local_env: BaseEnvironment) -> BaseEnvironment:
        return local_env

    def make_env(self, request: pytest.FixtureRequest, **options: object) -> BaseEnvironment:
        options.pop("reuse", None)
        env = LocalEnvironment(timeout=60, **options)  # type: ignore[arg-type]
        request.addfinalizer(env.close)
        return env

    def owner_spec(self, request: pytest.FixtureRequest) -> dict[str, object]:
        return {"backend": "local", "options": {}}


class TestLocalChild(_Local):
    """Children of this process, on a pipe or a PTY."""

    exit_latency_s = 0.1

    def test_exit_notification_within_100ms(self, local_env: BaseEnvironment, registry: ProcessRegistry) -> None:
        for _ in range(10):
            p = registry.spawn(local_env, "sleep 0.05; printf %s \"$EPOCHREALTIME\"")
            note = take(registry, NotificationKind.EXIT, p)
            assert note.time - float(note.text) < 0.1

    def test_own_process_group(self, local_env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = registry.spawn(local_env, "sleep 300")
        st = procinfo.proc_stat(p.pid or 0)
        assert st is not None and st.pgid == p.pid and st.sid == p.pid
        assert st.pgid != os.getpgid(0)
        p.kill()

    def test_secrets_filtered_like_foreground(self, monkeypatch: pytest.MonkeyPatch, registry: ProcessRegistry) -> None:
        monkeypatch.setenv("HBG_API_KEY", "secret")
        with LocalEnvironment() as env:
            p = registry.spawn(env, 'echo "${HBG_API_KEY-filtered}"')
            assert p.wait(30) == 0 and p.output == "filtered\n"

    def test_rolling_buffer_and_full_log(self, local_env: BaseEnvironment, tmp_path: Path) -> None:
        reg = make_registry(tmp_path, buffer_bytes=10_000, log_dir=tmp_path / "logs")
        try:
            p = reg.spawn(local_env, "seq 1 200000", log=True)
            assert p.wait(60) == 0
            full = "".join(f"{i}\n" for i in range(1, 200001)).encode()
            assert p.log_path and Path(p.log_path).read_bytes() == full
            held = p.read(0)
            assert held.dropped == len(full) - 10_000 and held.data == full[-10_000:]
            assert held.next_offset == len(full) == p.output_end
        finally:
            reg.close()

    def test_output_continues_from_a_child_after_exit(
        self, local_env: BaseEnvironment, registry: ProcessRegistry, tmp_path: Path
    ) -> None:
        fifo = tmp_path / "go"
        os.mkfifo(fifo)
        p = registry.spawn(local_env, f"(read _ <{fifo}; echo late) & echo main")
        assert p.wait(30) == 0 and p.output == "main\n"
        local_env.execute(f"echo >{fifo}")
        assert p.wait_for_output("late", 30)

    def test_add_watch_keeps_the_line_in_progress(self, local_env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = registry.spawn(local_env, "printf 'par'; read _; printf 'tial line\\n'", watch="nothing")
        assert p.wait_for_output("par", 30)
        p.add_watch(["partial", WatchPattern("^nothing$", regex=True)])
        p.submit("")
        note = take(registry, NotificationKind.MATCH, p)
        assert note.text == "partial line" and note.pattern == "partial"

    def test_pool_never_reaps_an_environment_with_live_processes(self, registry: ProcessRegistry) -> None:
        now = [0.0]
        with EnvironmentPool("local", idle_timeout=10.0, reap_interval=None, clock=lambda: now[0]) as pool:
            env = pool.get("t1")
            p = registry.spawn(env, "cat")
            now[0] = 100.0
            assert pool.reap_idle() == []
            assert not env.closed
            p.close_stdin()
            assert p.wait(30) == 0
            assert pool.reap_idle() == ["t1"]
            assert env.closed

    def test_pid_reuse_and_dead_pids_are_marked_lost_never_touched(self, tmp_path: Path) -> None:
        sleeper = subprocess.Popen(["sleep", "300"])
        done = subprocess.Popen(["true"])
        done.wait()
        try:
            start = procinfo.start_time(sleeper.pid)
            assert start is not None
            mine = procinfo.start_time(os.getpid())
            assert mine is not None
            base = {"command": "x", "backend": "local", "task_id": "t", "env_key": "local", "driver": "local"}
            live = [
                dict(base, id="bg-reused1", pid=sleeper.pid, start_time=start + 5, pgid=sleeper.pid),
                dict(base, id="bg-reused2", pid=os.getpid(), start_time=mine - 1, pgid=os.getpgid(0)),
                dict(base, id="bg-dead", pid=done.pid, start_time=1, pgid=done.pid),
            ]
            path = tmp_path / "cp.json"
            Checkpoint(path).update(owned=(), live=live, finished=[], keep_finished=10)
            reg = make_registry(checkpoint=path)
            try:
                got = {p.id: p for p in reg.recover()}
                assert set(got) == {"bg-reused1", "bg-reused2", "bg-dead"}
                for p in got.values():
                    assert p.status is ProcessStatus.LOST
                    assert [n.kind for n in p.notifications] == [NotificationKind.LOST]
                    with pytest.raises(ProcessError):
                        p.send_signal("TERM")
                    p.kill()  # already ended: a no-op, never a signal
                assert "another process" in (got["bg-reused1"].note or "")
                assert "no longer running" in (got["bg-dead"].note or "")
                data = Checkpoint(path).load()
                assert data["live"] == [] and {r["id"] for r in data["finished"]} == set(got)
            finally:
                reg.close()
            assert sleeper.poll() is None  # never signalled
        finally:
            sleeper.kill()
            sleeper.wait()

    def test_adopted_local_child_is_watched_and_killable(self, tmp_path: Path, marker: str) -> None:
        """A non-detached child whose owner crashed: output gone, but its end is seen and it can be killed."""
        path = tmp_path / "cp.json"
        owner = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("owner.py")),
             f'{{"backend": "local", "checkpoint": "{path}", "commands": [{{"command": "read _ </dev/null; exec sleep 300 # {marker}"}}]}}'],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parents[2]),
        )
        try:
            assert owner.stdout is not None
            [started] = __import__("json").loads(owner.stdout.readline())
        finally:
            owner.send_signal(signal.SIGKILL)
            owner.wait(10)
        reg = make_registry(checkpoint=path)
        try:
            [p] = reg.recover()
            assert p.running and p.pid == started["pid"] and p.driver_kind == "adopted"
            with pytest.raises(ProcessError):
                p.write("x")
            assert p.kill() is None and p.status is ProcessStatus.KILLED
            assert not procinfo.is_alive(started["pid"])
            assert [n.kind for n in p.notifications] == [NotificationKind.EXIT]
        finally:
            reg.close()

    def test_registry_close_kills_children(self, local_env: BaseEnvironment, tmp_path: Path) -> None:
        reg = make_registry(tmp_path)
        p = reg.spawn(local_env, "sleep 300")
        d = reg.spawn(local_env, "echo up; sleep 300", detached=True)
        assert d.wait_for_output("up", 30)
        reg.close()
        assert p.status is ProcessStatus.KILLED and not procinfo.is_alive(p.pid or 0)
        assert d.running and not d.followed and procinfo.is_alive(d.pid or 0)
        assert [r["id"] for r in Checkpoint(tmp_path / "processes.json").load()["live"]] == [d.id]
        other = make_registry(tmp_path)
        try:
            [again] = other.recover(local_env)
            assert again.output == "up\n" and again.running
            again.kill()
        finally:
            other.close()

    def test_big_script_state_over_argv_limit(self, local_env: BaseEnvironment, registry: ProcessRegistry) -> None:
        local_env.execute("HBG_BIG=$(head -c 200000 /dev/zero | tr '\\0' x)")
        p = registry.spawn(local_env, 'echo "${#HBG_BIG}"')
        assert p.wait(30) == 0 and p.output == "200000\n"


class TestLocalDetached(_Local):
    """``detached=True``: the sandbox path (log file, polls), run on this machine."""

    detached = True
    exit_latency_s = 0.3

    def test_detached_survives_environment_close(self, tmp_path: Path, marker: str) -> None:
        reg = make_registry(tmp_path)
        try:
            with LocalEnvironment() as env:
                p = reg.spawn(env, f"echo up; sleep 300 # {marker}", detached=True)
                assert p.wait_for_output("up", 30)
            assert env.closed and p.running and not p.followed
            assert procinfo.is_alive(p.pid or 0)
            with pytest.raises(ProcessError):
                p.kill()
        finally:
            reg.close()
        other = make_registry(tmp_path)
        try:
            with LocalEnvironment() as env2:
                [again] = other.recover(env2)
                assert again.kill() == 143
                assert wait_until(lambda: not procinfo.is_alive(p.pid or 0), 10)
        finally:
            other.close()

    def test_high_output_read_in_several_polls(self, local_env: BaseEnvironment, tmp_path: Path) -> None:
        from hermes_env_core.processes import PollSettings

        reg = make_registry(tmp_path, poll=PollSettings(min_s=0.02, max_s=0.2, max_read=64 * 1024), buffer_bytes=1 << 20)
        try:
            p = reg.spawn(local_env, "seq 1 100000; exit 4", detached=True, watch="99999")
            assert p.wait(60) == 4
            assert p.output == "".join(f"{i}\n" for i in range(1, 100001))
            assert [n.text for n in p.notifications if n.kind is NotificationKind.MATCH] == ["99999"]
        finally:
            reg.close()


def test_poll_backs_off_when_quiet(
    local_env: BaseEnvironment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quiet: the wait between polls grows to max_s; the exit still ends a wait at once."""
    import threading

    from hermes_env_core.processes import PollSettings
    from hermes_env_core.processes import sandbox as sandbox_mod

    starts: list[float] = []
    enough = threading.Event()
    real = sandbox_mod.run_script

    def counting(env: BaseEnvironment, script: str, *, timeout: float) -> tuple[int, bytes]:
        if "tail -c" in script and "__hbg_alive" in script:
            starts.append(time.monotonic())
            if len(starts) >= 8:
                enough.set()
        return real(env, script, timeout=timeout)

    monkeypatch.setattr(sandbox_mod, "run_script", counting)
    reg = make_registry(tmp_path, poll=PollSettings(min_s=0.02, max_s=0.32, factor=2.0))
    try:
        p = reg.spawn(local_env, "read _; echo done", detached=True)
        assert enough.wait(30)
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        # Each quiet poll waits twice as long as the one before, up to max_s.
        assert gaps[3] > gaps[0] * 3 and gaps[-1] >= 0.3, gaps
        t = time.monotonic()
        p.submit("x")
        assert p.wait(5) == 0
        assert time.monotonic() - t < 0.3 and p.output == "done\n"
    finally:
        reg.close()
