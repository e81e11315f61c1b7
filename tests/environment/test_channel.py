"""The session server on the local backend: what it adds beyond the
conformance suite (which runs through it in tests/backends/test_local.py).

Where the server and the process-per-command path must agree, both are checked
in the same test.
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
    """The session server's pid ($$ is the server's own shell)."""
    return {int(e.execute("echo $$").output)}


def test_same_process_facts_as_a_process_per_command():
    probe = 'echo "$0 ${LC_ALL-unset}"; bash -c \'grep -E "^(SigIgn|SigBlk)" /proc/self/status; ls /proc/self/fd | wc -l\''
    outs = []
    for channel in (True, False):
        with LocalEnvironment(channel=channel) as e:
            r = e.execute(probe)
            assert r.exit_code == 0, r.output
            outs.append(r.output)
            assert e.channel_mode.startswith("channel" if channel else "process")
    # A child sees the same signal dispositions either way, and under the server no descriptor of
    # ours: 0, 1, 2 and ls's own (the process path leaks one more).
    assert outs[0].splitlines()[:3] == outs[1].splitlines()[:3]
    assert outs[0].splitlines()[3] == "4"
    with LocalEnvironment() as e:
        # The session's shell is one level below the caller's, as a shell started from it would be.
        caller = int(os.environ.get("SHLVL", "0") or 0)
        assert e.execute("echo $SHLVL").output == f"{caller + 1}\n"


def test_late_background_output_lands_as_on_a_terminal(env):
    # As one bash at a terminal: a job's late output appears in whatever runs then,
    # and what it writes while no command runs is dropped, never read as a report.
    r = env.execute("(sleep 0.5; echo LATE-OUTPUT) & echo started")
    assert r.output == "started\n"
    r2 = env.execute("sleep 1.5; echo second")
    assert r2.output == "LATE-OUTPUT\nsecond\n"
    flag = f"/tmp/hermes_t_between_{os.getpid()}"
    r3 = env.execute(f"(sleep 0.2; echo BETWEEN; : >{flag}) &")
    assert r3.output == ""
    assert wait_until(lambda: os.path.exists(flag), 10)  # it wrote while no command ran
    os.unlink(flag)
    assert env.execute("echo third").output == "third\n"


def test_a_chatty_background_job_never_blocks_the_session(env):
    r = env.execute("(for i in $(seq 1 20000); do echo chatter-$i; done) & echo go")
    assert r.output.startswith("go\n") or "go\n" in r.output
    for _ in range(5):
        r = env.execute("echo still")
        assert r.exit_code == 0 and "still" in r.output.splitlines()
    env.execute("wait")


def test_binary_stdin_round_trips(env):
    data = bytes(range(256)) * 64 + b"\\0000\\\\x\x00"
    r = env.execute("od -An -v -tx1 | tr -d ' \\n'", stdin=data)
    assert r.output == data.hex()


def test_large_stdin_while_the_command_writes(env):
    data = os.urandom(3 << 20)
    r = env.execute("od -An -v -tx1 | wc -c", stdin=data)
    assert r.exit_code == 0 and int(r.output) > len(data) * 3


def test_timeout_then_a_new_server_with_the_state(env):
    before = _server_pids(env)
    env.execute("export HERMES_T_TO=kept; cd /tmp")
    r = env.execute("sleep 30", timeout=0.5)
    assert r.timed_out
    r = env.execute('echo "$HERMES_T_TO"; pwd')
    assert r.output == "kept\n/tmp\n"
    assert any("timed out" in n and "new session server" in n for n in r.notes), r.notes
    assert _server_pids(env) != before


def test_concurrent_calls_run_one_at_a_time():
    with LocalEnvironment(timeout=60) as e:
        outs: dict[int, str] = {}

        def run(i: int) -> None:
            outs[i] = e.execute(f"HERMES_T_C={i}; sleep 0.2; echo $HERMES_T_C").output

        t0 = time.monotonic()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # One shell: each saw its own assignment, and they did not overlap.
        assert outs == {i: f"{i}\n" for i in range(4)}
        assert time.monotonic() - t0 >= 0.8


def test_server_killed_mid_command_is_a_result_then_a_new_server(env):
    (pid,) = _server_pids(env)
    env.execute("export HERMES_T_K=kept")
    threading.Timer(0.5, lambda: os.kill(pid, signal.SIGKILL)).start()
    r = env.execute("sleep 30", timeout=20)
    # The local shell's own status: killed by SIGKILL.
    assert r.exit_code == 137 and r.duration_s < 10
    r = env.execute('echo "$HERMES_T_K"')
    assert r.output == "kept\n" and any("new session server" in n for n in r.notes)
    assert _server_pids(env) and _server_pids(env) != {pid}


def test_server_killed_while_idle_is_noted_on_the_next_command(env):
    (pid,) = _server_pids(env)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not env._runner._server.alive, 10)
    r = env.execute("echo after")
    assert r.output == "after\n" and any("new session server" in n for n in r.notes)


def test_no_bash_in_the_target_is_a_clear_error():
    with LocalEnvironment(bash="/bin/sh") as e:
        # /bin/sh (dash here) cannot be the session's server: the error says what is missing.
        try:
            r = e.execute("echo x")
        except Exception as exc:  # noqa: BLE001 - the message is the test
            assert "session server" in str(exc) or "bash" in str(exc)
        else:
            assert r.output == "x\n"


def test_channel_off_by_configuration():
    with LocalEnvironment(channel=False) as e:
        assert e.execute("echo x").output == "x\n"
        assert e._runner is None
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


def test_usage_through_the_server_has_the_trees_cpu_and_peak_memory(env):
    burn = 'python3 -c "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"'
    r = env.execute(f"{burn}; echo done")
    assert r.output == "done\n"
    assert r.usage.cpu_user_s is not None and r.usage.cpu_system_s is not None
    assert r.usage.cpu_user_s + r.usage.cpu_system_s >= 0.4
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


def _cat_stream(**kw):
    import subprocess

    from hermes_env_core.environment.channel import PipeStream

    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    return proc, PipeStream(proc.stdin, proc.stdout, on_close=lambda: (proc.kill(), proc.wait()), **kw)


@pytest.mark.parametrize("exited", [False, True], ids=["no-exit-check", "exit-check"])
def test_closing_a_pipe_stream_ends_a_read_waiting_in_another_thread(exited):
    """The session server's reader thread waits in read(); close() from the
    client must end that read, not leave it holding a descriptor number."""
    import threading

    proc, stream = _cat_stream(exited=(lambda: proc.poll() is not None) if exited else None)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(stream.read(100)), daemon=True)
    reader.start()
    stream.write(b"one\n")
    reader.join(10)
    assert got == [b"one\n"]
    reader = threading.Thread(target=lambda: got.append(stream.read(100)), daemon=True)
    reader.start()
    stream.close()
    reader.join(10)
    assert not reader.is_alive() and got == [b"one\n", b""]


def test_a_closed_pipe_stream_never_reads_or_writes_a_reused_descriptor():
    """After close(), the stream's old descriptor numbers may belong to a new
    pipe (the next server's): the closed stream must leave its bytes alone."""
    import os

    proc, stream = _cat_stream(exited=lambda: proc.poll() is not None)
    old = (stream._rfd, stream._wfd)
    stream.close()
    pipes = [os.pipe() for _ in range(4)]  # the lowest free numbers: the old ones among them
    try:
        taken = {fd for pair in pipes for fd in pair}
        assert set(old) & taken, "the test needs a reused descriptor number"
        for r, w in pipes:
            os.write(w, b"next server")
        assert stream.read(100) == b""
        with pytest.raises(OSError):
            stream.write(b"late")
        for r, w in pipes:
            assert os.read(r, 100) == b"next server"
    finally:
        for pair in pipes:
            for fd in pair:
                os.close(fd)
