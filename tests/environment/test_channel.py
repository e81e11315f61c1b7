"""The resident shell channel on the local backend: what the channel adds beyond
the conformance suite (which runs through it in tests/backends/test_local.py).

Each fact is checked against the process-per-command path in the same test
where the two must agree.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.environment import channel as channel_mod
from hermes_env_core.errors import BackendError
from hermes_env_core.testing import wait_until


@pytest.fixture
def env():
    with LocalEnvironment(timeout=60, channel=True) as e:
        e.execute("true")
        assert e.channel_mode == "channel"
        yield e


def _server_pids(e: LocalEnvironment) -> set[int]:
    pool = e._channels
    assert pool is not None
    return {ch.server_pid for ch in pool._all if ch.dead is None and ch.server_pid}


def test_same_process_facts_as_a_process_per_command():
    probe = (
        'echo "$0 $SHLVL ${LC_ALL-unset}"; grep -E "^(SigIgn|SigBlk)" /proc/self/status; '
        "for f in /proc/$$/fd/*; do printf '%s ' \"${f##*/}\"; done"
    )
    outs = []
    for channel in (True, False):
        with LocalEnvironment(channel=channel) as e:
            r = e.execute(probe)
            assert r.exit_code == 0, r.output
            outs.append(r.output)
            assert e.channel_mode.startswith("channel" if channel else "process")
    assert outs[0] == outs[1]


def test_late_background_output_never_lands_in_a_later_result(env):
    r = env.execute("(sleep 0.5; echo LATE-OUTPUT) & echo started")
    assert r.output == "started\n"
    r2 = env.execute("sleep 1.5; echo second")
    assert r2.output == "second\n"
    assert "LATE" not in env.execute("echo third").output


def test_late_background_writer_gets_epipe_not_a_blocked_channel(env):
    f = f"/tmp/hermes_t_epipe_{os.getpid()}"
    r = env.execute(f"(trap '' PIPE; sleep 0.3; n=0; for i in $(seq 1 1000); do echo x || break; n=$((n+1)); done; echo \"n=$n\" >{f}) & echo go")
    assert r.output == "go\n"
    assert wait_until(lambda: os.path.exists(f) and open(f).read().strip() != "", 10)
    assert open(f).read().strip() == "n=0"  # its output has nowhere to go
    os.unlink(f)
    assert env.execute("echo still").output == "still\n"


def test_binary_stdin_round_trips(env):
    data = bytes(range(256)) * 64 + b"\\0000\\\\x\x00"
    r = env.execute("od -An -v -tx1 | tr -d ' \\n'", stdin=data)
    assert r.output == data.hex()


def test_large_stdin_while_the_command_writes(env):
    data = os.urandom(3 << 20)
    r = env.execute("od -An -v -tx1 | wc -c", stdin=data)
    assert r.exit_code == 0 and int(r.output) > len(data) * 3


def test_timeout_leaves_the_same_channel_usable(env):
    before = _server_pids(env)
    r = env.execute("sleep 30", timeout=0.5)
    assert r.timed_out
    assert env.execute("echo ok").output == "ok\n"
    assert _server_pids(env) == before


def test_concurrent_commands_open_channels_up_to_the_limit_then_queue():
    with LocalEnvironment(max_channels=2, channel=True) as e:
        e.execute("true")
        d = "/tmp/hermes_t_par_" + os.urandom(4).hex()
        e.execute(f"mkdir {d}")
        results = []
        # Each waits until two run at once (only possible in parallel), and
        # reports how many it saw running (more than two: the limit leaked).
        cmd = (f"touch {d}/run.$$; n=0; while c=$(ls {d} | wc -l); [ $c -lt 2 ]; do sleep 0.02; "
               f"n=$((n+1)); [ $n -gt 500 ] && exit 9; done; ls {d} | wc -l; sleep 0.1; rm {d}/run.$$")

        def run():
            results.append(e.execute(cmd))

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        e.execute(f"rm -rf {d}")
        assert [r.exit_code for r in results] == [0, 0, 0, 0], [r.output for r in results]
        assert all(int(r.output) == 2 for r in results), [r.output for r in results]
        assert e._channels is not None and e._channels.opened == 2


def test_server_killed_mid_command_is_an_infrastructure_error_then_reopens(env):
    (pid,) = _server_pids(env)
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(BackendError, match="lost"):
        env.execute("sleep 5; echo never")
    killer.join()
    r = env.execute("echo back")
    assert r.output == "back\n"
    assert _server_pids(env) and _server_pids(env) != {pid}


def test_server_killed_while_idle_is_noted_on_the_next_command(env):
    env.execute("export HERMES_T_KEEP=1")
    (pid,) = _server_pids(env)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: env._channels is not None and all(ch.dead for ch in env._channels._all), 10)
    r = env.execute('echo "$HERMES_T_KEEP"')
    assert r.output == "1\n"
    assert any("channel lost" in n for n in r.notes)


def test_old_bash_falls_back_to_processes_with_a_note(monkeypatch):
    monkeypatch.setattr(channel_mod, "SERVER_MIN_BASH", 9999)
    with LocalEnvironment(channel=True) as e:
        r = e.execute("echo hi")
        assert r.output == "hi\n"
        assert any("one process per command" in n for n in r.notes)
        assert e.channel_mode.startswith("process (the channel was refused")
        assert not any("one process" in n for n in e.execute("true").notes)


def test_channel_off_by_configuration():
    with LocalEnvironment(channel=False) as e:
        assert e.execute("echo x").output == "x\n"
        assert e._channels is None
        assert e.channel_mode == "process (channel turned off by configuration)"


def test_close_stops_the_servers(env):
    pids = _server_pids(env)
    env.close()

    def gone() -> bool:
        return all(not os.path.exists(f"/proc/{p}") or open(f"/proc/{p}/stat").read().split(") ")[1][0] == "Z"
                   for p in pids)

    assert wait_until(gone, 10)


def test_huge_output_streams_with_bounded_memory(env):
    # 200 MB through the relay and the pipe: the capture keeps head and tail only.
    t0 = time.monotonic()
    r = env.execute("head -c 200000000 /dev/zero | tr '\\0' z; echo; echo END")
    assert r.truncated and r.output.endswith("z\nEND\n")
    assert r.dropped_bytes > 190_000_000
    assert time.monotonic() - t0 < 60


def test_usage_through_the_channel_has_the_trees_cpu(env):
    burn = 'python3 -c "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"'
    r = env.execute(f"{burn}; echo done")
    assert r.output == "done\n"
    assert r.usage.cpu_user_s is not None and r.usage.cpu_system_s is not None
    assert r.usage.cpu_user_s + r.usage.cpu_system_s >= 0.4
    assert r.usage.max_rss_bytes is None  # bash cannot tell; the process path can
    r = env.execute("kill -9 $$")
    assert (r.exit_code, r.signal) == (137, 9)


def test_a_target_that_offers_open_channel_gets_the_channel():
    """A third-party backend written against ``Target`` opts in with one method."""
    import shutil
    import subprocess
    import tempfile

    from hermes_env_core.environment.channel import PipeStream
    from hermes_env_core.environment.target import RunRequest, Target, TargetEnvironment
    from hermes_env_core.backends.local import start_bash

    class PipeTarget(Target):
        def __init__(self) -> None:
            self.dir = tempfile.mkdtemp(prefix="hermes-t-chan-")
            self.opened = 0

        def start(self, request: RunRequest):
            return start_bash(request)

        def open_channel(self, argv):
            self.opened += 1
            proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            return PipeStream(proc.stdin, proc.stdout, on_close=lambda: (proc.kill(), proc.wait()),
                              exited=lambda: proc.poll() is not None)

        def state_dir(self) -> str:
            return self.dir

        def recover(self, why: str) -> bool:
            return False

        def release(self) -> None:
            shutil.rmtree(self.dir, ignore_errors=True)

    class PipeEnvironment(TargetEnvironment):
        name = "pipe"

        def make_target(self, config):
            return PipeTarget()

    with PipeEnvironment() as e:
        assert e.execute("x=7; cd /tmp").exit_code == 0
        assert e.execute('echo "$x $PWD"').output == "7 /tmp\n"
        assert e.channel_mode == "channel" and e.target.opened == 1
