"""Behaviours every backend's background processes share; each backend's test class subclasses this.

Real processes only. Waits are on events, queues and the output itself,
each with a timeout; no test sleeps a fixed time.
"""

from __future__ import annotations

import json
import queue
import shlex
import statistics
import time
from pathlib import Path

import pytest

from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.errors import UnsupportedOperation
from hermes_env_core.processes import (
    BackgroundProcess,
    Notification,
    NotificationKind,
    ProcessError,
    ProcessRegistry,
    ProcessStatus,
    RateLimit,
    WatchPattern,
)
from hermes_env_core.processes.checkpoint import Checkpoint
from hermes_env_core.testing import wait_until
from tests.processes.bgsupport import make_registry

ALIVE_FN = (
    'alive() { local s; [ -r /proc/$1/stat ] || return 1; IFS= read -r s </proc/$1/stat || return 1; '
    's=${s##*) }; [ "${s%% *}" != Z ]; }; '
)


def take(registry: ProcessRegistry, kind: NotificationKind, proc: BackgroundProcess, timeout: float = 15.0) -> Notification:
    """The next notification of ``kind`` for ``proc`` from the queue (others are dropped)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {kind} notification for {proc} in {timeout}s; output: {proc.output[-500:]!r}")
        note = registry.next_notification(left)
        if note is not None and note.kind is kind and note.process_id == proc.id:
            return note


def queued(registry: ProcessRegistry) -> list[Notification]:
    out = []
    while True:
        try:
            out.append(registry.notifications.get_nowait())
        except queue.Empty:
            return out


class BackgroundSuite:
    #: a background process in this environment gets a terminal (else: UnsupportedOperation)
    pty_supported = True
    #: exit-to-notification bound, seconds
    exit_latency_s = 0.5
    #: spawn detached (exercises the sandbox path on local)
    detached = False

    @pytest.fixture
    def env(self) -> BaseEnvironment:
        raise NotImplementedError

    def make_env(self, request: pytest.FixtureRequest, **options: object) -> BaseEnvironment:
        """A second environment on the same target (for close and recovery tests)."""
        raise NotImplementedError

    def spawn(self, registry: ProcessRegistry, env: BaseEnvironment, command: str, **kw: object) -> BackgroundProcess:
        kw.setdefault("detached", self.detached)
        return registry.spawn(env, command, **kw)  # type: ignore[arg-type]

    def alive(self, env: BaseEnvironment, pid: int | str) -> bool:
        return env.execute(ALIVE_FN + f"alive {int(pid)}").exit_code == 0

    # -- state, output, exit ------------------------------------------------------------
    def test_sees_the_session_state(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        env.execute("export HERMES_BG_X='a b'; HERMES_BG_PLAIN=p; hbg_fn() { echo fn $1; }; mkdir -p /tmp/hbg_dir; cd /tmp/hbg_dir")
        p = self.spawn(registry, env, 'echo "$HERMES_BG_X|$HERMES_BG_PLAIN|$PWD"; hbg_fn ok')
        assert p.wait(30) == 0
        assert p.output == "a b|p|/tmp/hbg_dir\nfn ok\n"
        assert p.pid and p.pid > 0 and p.started_at <= time.time()

    def test_missing_cwd_is_126_naming_it(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(registry, env, "pwd", cwd="/no/such/hbg/dir")
        assert p.wait(30) == 126
        assert "/no/such/hbg/dir" in p.output

    def test_exit_notification_once_with_code_and_last_2000_chars(
        self, env: BaseEnvironment, registry: ProcessRegistry
    ) -> None:
        calls: list[Notification] = []
        p = self.spawn(
            registry, env, "for i in $(seq 1 400); do printf '%09d\\n' $i; done; exit 7", on_notification=calls.append
        )
        note = take(registry, NotificationKind.EXIT, p)
        full = "".join(f"{i:09d}\n" for i in range(1, 401))
        assert note.exit_code == 7 and note.status == "exited"
        assert note.text == full[-2000:]
        assert p.status is ProcessStatus.EXITED and p.exit_code == 7
        assert wait_until(lambda: len(calls) == 1, 5)
        registry.close()  # flushes the callback dispatcher
        assert [n.seq for n in calls] == [note.seq]
        assert not [n for n in queued(registry) if n.kind is NotificationKind.EXIT]

    def test_no_exit_notification_when_not_asked(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(registry, env, "true", notify_on_exit=False)
        assert p.wait(30) == 0
        registry.close()
        assert not [n for n in queued(registry) if n.process_id == p.id]

    def test_exit_seen_promptly(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        # The command prints the time just before it exits.
        lags = []
        for _ in range(5):
            p = self.spawn(registry, env, "sleep 0.2; printf %s \"$EPOCHREALTIME\"")
            note = take(registry, NotificationKind.EXIT, p)
            lags.append(note.time - float(note.text))
        assert statistics.median(lags) < self.exit_latency_s, lags
        assert max(lags) < self.exit_latency_s * 3, lags

    def test_read_since_offsets(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(registry, env, "printf 'one\\n€'; read _; printf 'two\\n'")
        assert p.wait_for_output("€", 30)
        first = p.read(0)
        assert first.text == "one\n€" and first.offset == 0 and first.next_offset == len("one\n€".encode())
        p.submit("")
        assert p.wait(30) == 0
        second = p.read(first.next_offset)
        assert second.text == "two\n" and second.dropped == 0

    # -- watches ----------------------------------------------------------------------------
    def test_split_line_watch_matches_once(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        # The line is cut between two reads for certain: its second half is
        # written only after the test has seen the first.
        p = self.spawn(
            registry, env, "printf 'not me\\nserver rea'; read _; printf 'dy on 8080\\nready? no\\n'", watch="ready on"
        )
        assert p.wait_for_output("server rea", 30)
        assert not [n for n in queued(registry) if n.kind is NotificationKind.MATCH]
        p.submit("go")
        note = take(registry, NotificationKind.MATCH, p)
        assert note.text == "server ready on 8080" and note.pattern == "ready on"
        assert p.wait(30) == 0
        registry.close()
        assert not [n for n in queued(registry) if n.kind is NotificationKind.MATCH]

    def test_regex_watch_matches_within_lines(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(
            registry,
            env,
            "printf 'error\\nfoo\\nERROR: disk full\\npartial error: x'",
            watch=[WatchPattern(r"^error:\s+\w+", regex=True, ignore_case=True)],
        )
        assert p.wait(30) == 0
        lines = [n.text for n in p.notifications if n.kind is NotificationKind.MATCH]
        assert lines == ["ERROR: disk full"]

    def test_last_line_without_newline_is_matched_at_exit(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(registry, env, "printf 'started\\nlistening on :3000'", watch="listening")
        match = take(registry, NotificationKind.MATCH, p)
        exit_note = take(registry, NotificationKind.EXIT, p)
        assert match.text == "listening on :3000" and match.seq < exit_note.seq

    def test_rate_limit_then_watch_disabled(self, env: BaseEnvironment, tmp_path: Path) -> None:
        limit = RateLimit(max_matches=3, window_s=0.3, disable_after_s=0.9)
        reg = make_registry(tmp_path, rate_limit=limit)
        try:
            p = self.spawn(reg, env, "while :; do echo tick; sleep 0.005; done", watch="tick")
            disabled = take(reg, NotificationKind.WATCH_DISABLED, p, timeout=30)
            notes = [n for n in p.notifications if n.kind is NotificationKind.MATCH]
            delivered, suppressed = p.watch_stats
            assert p.watch_disabled
            assert len(notes) == delivered and suppressed > 0
            assert disabled.suppressed == suppressed and f"{suppressed} matches were suppressed" in disabled.text
            # At most 3 per window (the exact windows are checked with a fake clock in test_bg_parts).
            span = disabled.time - notes[0].time
            assert delivered <= limit.max_matches * (int(span / limit.window_s) + 1)
            assert delivered >= limit.max_matches * 2  # several windows ran before it was disabled
            # Output goes on; notifications do not.
            end = p.output_end
            assert p._buffer.wait(end + 500, 30)
            assert len([n for n in p.notifications if n.kind is NotificationKind.MATCH]) == delivered
            p.kill()
        finally:
            reg.close()

    # -- stdin, signals, kill -----------------------------------------------------------------
    def test_stdin_write_submit_close(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(registry, env, "while IFS= read -r l; do echo \"got<$l>\"; done; echo eof")
        p.write("par")
        p.write(b"tial\n")
        p.submit("line two")
        assert p.wait_for_output("got<line two>", 30)
        p.close_stdin()
        assert p.wait(30) == 0
        assert p.output == "got<partial>\ngot<line two>\neof\n"
        with pytest.raises(ProcessError):
            p.write("late\n")

    def test_send_signal(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(registry, env, "trap 'echo got-usr1; exit 5' USR1; echo ready; while :; do sleep 0.05; done")
        assert p.wait_for_output("ready", 30)
        p.send_signal("USR1")
        assert p.wait(30) == 5
        assert "got-usr1" in p.output

    def test_kill_ends_the_whole_tree(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(
            registry, env, "trap '' TERM; sleep 300 & echo child $!; (setsid sleep 301 & echo grand $!; wait) & wait"
        )
        assert p.wait_for_output("grand ", 30) and p.wait_for_output("child ", 30)
        words = p.output.split()
        child, grand = words[words.index("child") + 1], words[words.index("grand") + 1]
        assert self.alive(env, child) and self.alive(env, grand)
        code = p.kill(grace=0.5)
        assert p.status is ProcessStatus.KILLED and code in (137, 143), (p.status, code, p.output)
        assert wait_until(lambda: not self.alive(env, child) and not self.alive(env, grand), 10)
        note = [n for n in p.notifications if n.kind is NotificationKind.EXIT]
        assert len(note) == 1 and note[0].status == "killed"

    # -- terminals --------------------------------------------------------------------------
    def test_pty_program_answers_a_prompt(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        if not self.pty_supported:
            with pytest.raises(UnsupportedOperation, match="pty"):
                self.spawn(registry, env, "read -p 'name? ' n", pty=True)
            return
        p = self.spawn(registry, env, "[ -t 0 ] && echo tty; read -p 'name? ' n; echo hi $n", pty=True)
        assert p.wait_for_output("name? ", 30)
        p.submit("bob")
        assert p.wait(30) == 0
        assert p.output.replace("\r\n", "\n") == "tty\nname? bob\nhi bob\n"

    def test_pty_window_size(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        if not self.pty_supported:
            with pytest.raises(UnsupportedOperation, match="script"):
                self.spawn(registry, env, "stty size", pty=True, window=(30, 100))
            return
        p = self.spawn(registry, env, "stty size; read _; stty size", pty=True, window=(30, 100))
        assert p.wait_for_output("30 100", 30)
        p.set_window_size(40, 120)  # done when it returns: the next stty sees it
        p.submit("")
        assert p.wait(30) == 0
        assert p.output.replace("\r\n", "\n").endswith("40 120\n")

    def test_pty_eof_and_signal(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        if not self.pty_supported:
            return  # spawning is refused, see test_pty_program_answers_a_prompt
        p = self.spawn(registry, env, "cat; echo after-eof", pty=True)
        p.submit("abc")
        assert p.wait_for_output("abc\r\nabc", 30)  # the terminal's echo, then cat's copy
        p.close_stdin()
        assert p.wait(30) == 0 and p.output.endswith("after-eof\r\n")
        q = self.spawn(
            registry, env, "trap 'echo got-int; exit 3' INT; echo ready; while :; do sleep 0.05; done", pty=True
        )
        assert q.wait_for_output("ready", 30)
        q.send_signal("INT")
        assert q.wait(30) == 3 and "got-int" in q.output

    def test_window_size_needs_a_pty(self, env: BaseEnvironment, registry: ProcessRegistry) -> None:
        p = self.spawn(registry, env, "true")
        with pytest.raises(UnsupportedOperation):
            p.set_window_size(10, 10)

    # -- environment lifecycle ----------------------------------------------------------------
    def test_closing_the_environment_kills_its_processes(
        self, request: pytest.FixtureRequest, registry: ProcessRegistry, env: BaseEnvironment, marker: str
    ) -> None:
        other = self.make_env(request)
        p = self.spawn(registry, other, f"sleep 300 # {marker}", detached=False)
        assert other._has_live_processes()
        assert not env._has_live_processes()
        other.close()
        assert p.status is ProcessStatus.KILLED
        assert not other._has_live_processes()
        if env.name != "docker":  # the container went with the environment
            assert not self.alive(env, p.pid or 0)

    def test_pid_reuse_is_never_adopted(
        self, env: BaseEnvironment, registry: ProcessRegistry, tmp_path: Path, marker: str
    ) -> None:
        p = self.spawn(registry, env, f"echo up; sleep 300 # {marker}", detached=True)
        assert p.wait_for_output("up", 30)
        assert registry.checkpoint is not None
        rec = next(r for r in registry.checkpoint.load()["live"] if r["id"] == p.id)
        fake = dict(rec, start_time=rec["start_time"] + 1)  # same pid, another process's start time
        path = tmp_path / "fake.json"
        Checkpoint(path).update(owned=(), live=[fake], finished=[], keep_finished=10)
        other = make_registry(checkpoint=path)
        try:
            [lost] = other.recover(env)
            assert lost.status is ProcessStatus.LOST and "another process" in (lost.note or "")
            assert [n.kind for n in lost.notifications] == [NotificationKind.LOST]
            with pytest.raises(ProcessError):
                lost.send_signal("KILL")
            assert lost.kill() is None  # it ended (for us): a no-op, never a signal
            other.close()
            assert p.running and self.alive(env, p.pid or 0)
            assert not Checkpoint(path).load()["live"]
        finally:
            other.close()
            p.kill()

    # -- recovery after the owner died --------------------------------------------------------
    def owner_spec(self, request: pytest.FixtureRequest) -> dict[str, object]:
        """How the owner subprocess opens this environment (see owner.py)."""
        raise NotImplementedError

    def test_recovered_after_the_owner_is_killed(
        self, request: pytest.FixtureRequest, tmp_path: Path, marker: str
    ) -> None:
        import subprocess
        import sys

        checkpoint = tmp_path / "owner.json"
        spec = dict(self.owner_spec(request))
        spec.update(
            checkpoint=str(checkpoint),
            commands=[
                {"command": f"echo before; read _; echo after; sleep 300 # {marker}", "detached": True, "watch": "after",
                 "ready": "before"},
                {"command": f"sleep 300 # {marker}b", "detached": self.detached},
            ],
        )
        owner = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("owner.py")), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        try:
            assert owner.stdout is not None
            started = json.loads(owner.stdout.readline() or "null")
            assert started, "the owner process did not start its commands"
        finally:
            owner.kill()  # SIGKILL: no cleanup, no checkpoint update
            owner.wait(10)
        env = self.make_env(request, reuse=True)
        reg = make_registry(checkpoint=checkpoint)
        try:
            recovered = {p.id: p for p in reg.recover(env)}
            assert set(recovered) == {s["id"] for s in started}
            first, second = (recovered[s["id"]] for s in started)
            assert first.running and second.running
            assert first.output == "before\n"  # kept in the target's log
            first.submit("go")
            note = take(reg, NotificationKind.MATCH, first)
            assert note.text == "after"
            second.kill()
            assert second.status is ProcessStatus.KILLED
            assert first.kill() in (137, 143)
            assert not Checkpoint(checkpoint).load()["live"]
        finally:
            reg.close()
            env.close()

    # -- hygiene ------------------------------------------------------------------------------
    def test_finished_processes_pruned_by_count(self, env: BaseEnvironment, tmp_path: Path) -> None:
        reg = make_registry(tmp_path, keep_finished=2)
        try:
            procs = []
            for i in range(4):  # one after the other: the oldest to end are dropped first
                procs.append(self.spawn(reg, env, f"echo {i}"))
                procs[-1].wait(30)
            assert wait_until(lambda: [p.id for p in reg.list()] == [p.id for p in procs[2:]], 10)
            assert [r["id"] for r in reg.checkpoint.load()["finished"]] == [p.id for p in procs[2:]]  # type: ignore[union-attr]
        finally:
            reg.close()

    def test_finished_processes_pruned_by_age(self, env: BaseEnvironment, tmp_path: Path) -> None:
        reg = make_registry(tmp_path, keep_finished_s=0.0)
        try:
            p = self.spawn(reg, env, "echo x")
            p.wait(30)
            assert reg.list() == [] and p.id not in reg
            if p.driver_kind == "sandbox":
                d = p._driver.dir  # type: ignore[attr-defined]
                assert wait_until(lambda: env.execute(f"test -e {shlex.quote(d)}").exit_code != 0, 10)
        finally:
            reg.close()
