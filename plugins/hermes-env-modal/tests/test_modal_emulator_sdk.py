"""The official ``modal`` SDK (1.6.x), unmodified, against the local emulator.

These tests use only public SDK calls; the emulator is inspected only to check what
happened on the "server" side (processes, resources, call counts).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import modal
import modal.exception
import pytest
from grpclib import Status


def _load_emulator():
    """Import tests/emulator under a name of its own: other plugins may ship an 'emulator' too."""
    name = "hermes_env_modal_test_emulator"
    if name not in sys.modules:
        pkg_dir = Path(__file__).resolve().parent / "emulator"
        spec = importlib.util.spec_from_file_location(
            name, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_emulator = _load_emulator()
ModalEmulator, pointed_at = _emulator.ModalEmulator, _emulator.pointed_at

TEST_TIMEOUT_S = 90  # hard bound per test, emulator start/stop included


@pytest.fixture(autouse=True)
def _hard_timeout():
    """Fail a hung test instead of letting the SDK's retry loops run on (pytest-timeout-free)."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded {TEST_TIMEOUT_S}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def emu():
    with ModalEmulator() as emulator:
        with pointed_at(emulator):
            yield emulator
        assert not emulator.errors, emulator.errors
        assert not emulator.unimplemented, (
            f"SDK called unemulated RPCs: {sorted(emulator.unimplemented)}"
        )


@pytest.fixture
def app(emu):
    return modal.App.lookup("hermes-env-emulator-tests", create_if_missing=True)


@pytest.fixture
def sb(emu, app):
    sandbox = modal.Sandbox.create(
        app=app, image=modal.Image.debian_slim(), timeout=300
    )
    yield sandbox
    sandbox.terminate()


def _only_exec(emu, sandbox_id, needle):
    procs = [
        p
        for p in emu.sandboxes[sandbox_id].execs.values()
        if needle in " ".join(p.argv)
    ]
    assert len(procs) == 1, procs
    return procs[0]


def test_client_hello_and_auth(emu):
    modal.Client.from_env().hello()
    assert emu.call_count("ClientHello") == 1
    bad = modal.Client.from_credentials("ak-wrong", "as-wrong")
    try:
        with pytest.raises(modal.exception.AuthError):
            modal.App.lookup("any-app", create_if_missing=True, client=bad)
    finally:
        bad.close()


def test_create_sandbox_passes_resources_and_runs(emu, app):
    sandbox = modal.Sandbox.create(
        app=app,
        image=modal.Image.from_registry("python:3.11-slim"),
        timeout=120,
        workdir="/workspace",
        cpu=0.5,
        memory=256,
    )
    try:
        state = emu.sandboxes[sandbox.object_id]
        assert (
            state.timeout_secs,
            state.workdir,
            state.milli_cpu,
            state.memory_mb,
        ) == (120, "/workspace", 500, 256)
        assert state.image_id in emu.images
        assert sandbox.poll() is None
        assert modal.App.lookup("hermes-env-emulator-tests").app_id == app.app_id
        with pytest.raises(modal.exception.NotFoundError):
            modal.App.lookup("no-such-app")
    finally:
        sandbox.terminate()


def test_exec_echo_and_exit_code(emu, sb):
    p = sb.exec("bash", "-c", "echo hello; echo oops >&2; exit 7")
    assert p.stdout.read() == "hello\n"
    assert p.stderr.read() == "oops\n"
    assert p.wait() == 7
    assert p.returncode == 7
    assert sb.exec("true").wait() == 0


def test_exec_runs_in_sandbox_dir_with_env(emu, app):
    sandbox = modal.Sandbox.create(
        app=app, timeout=60, workdir="/workspace", env={"SB_LEVEL": "sb"}
    )
    try:
        root = emu.sandboxes[sandbox.object_id].root
        (root / "sub").mkdir()
        p = sandbox.exec(
            "bash",
            "-c",
            'pwd; echo "$SB_LEVEL $EXEC_LEVEL"',
            workdir="/workspace/sub",
            env={"EXEC_LEVEL": "ex"},
        )
        assert p.stdout.read().splitlines() == [str(root / "sub"), "sb ex"]
        assert p.wait() == 0
    finally:
        sandbox.terminate()


def test_stdout_streams_in_order_as_produced(emu, sb):
    # The rest is only printed once the test, having seen "first", answers on stdin:
    # proof that output is streamed while the process runs, not delivered at its exit.
    script = 'echo first; read -r go; [ "$go" = go ] || exit 9; for i in 2 3 4 5; do echo line$i; done'
    p = sb.exec("bash", "-c", script, bufsize=1)
    lines = iter(p.stdout)
    assert next(lines) == "first\n"
    assert p.poll() is None  # still running: "first" arrived before the exit
    p.stdin.write(b"go\n")
    p.stdin.drain()
    assert list(lines) == [f"line{i}\n" for i in (2, 3, 4, 5)]
    assert p.wait() == 0


def test_stdin_write_and_eof(emu, sb):
    p = sb.exec("bash", "-c", "cat; echo done")
    p.stdin.write(b"hello\n")
    p.stdin.write("world\n")
    p.stdin.write_eof()
    p.stdin.drain()
    assert p.stdout.read() == "hello\nworld\ndone\n"
    assert p.wait() == 0


def test_stdin_large_payload(emu, sb):
    payload = os.urandom(
        5 * 1024 * 1024
    )  # one TaskExecStdinWrite message larger than 4 MiB
    p = sb.exec("sha256sum")
    p.stdin.write(payload)
    p.stdin.write_eof()
    p.stdin.drain()
    assert p.stdout.read().split()[0] == hashlib.sha256(payload).hexdigest()
    assert p.wait() == 0


def test_exec_timeout_kills_the_process(emu, sb):
    started = time.monotonic()
    p = sb.exec("bash", "-c", "sleep 60 & wait", timeout=1)
    rc = p.wait()
    assert time.monotonic() - started < 10
    # The SDK's own deadline usually fires first and wait() then returns -1; if the
    # emulator's kill is seen first, the SIGKILL shows as 137.
    assert rc in (-1, 137)
    proc = _only_exec(emu, sb.object_id, "sleep 60")
    assert emu.run(proc.wait(10), timeout=15)
    assert proc.timed_out and proc.exit_signal == signal.SIGKILL


def test_exec_timeout_output_must_be_read_before_the_deadline(emu, sb):
    # SDK behaviour worth knowing: once an exec's deadline has passed, reading its stdout
    # returns nothing, so output of a command with timeout= must be read while it runs.
    p = sb.exec("bash", "-c", "echo partial; sleep 60", timeout=1)
    assert p.stdout.read() == "partial\n"
    assert p.wait() in (-1, 137)
    p = sb.exec("bash", "-c", "echo partial; sleep 60", timeout=1)
    assert p.wait() in (-1, 137)
    assert p.stdout.read() == ""


def test_wait_reports_the_exit_while_a_background_child_holds_stdout(emu, sb):
    # A container runtime reports an exec's exit when its process exits; the pipe
    # stays open as long as the child lives (stdout then ends only with the child).
    started = time.monotonic()
    p = sb.exec("bash", "-c", "sleep 30 & echo $!", text=False)
    pid = next(iter(p.stdout)).strip()
    assert pid.isdigit()
    assert p.wait() == 0
    assert time.monotonic() - started < 5
    assert sb.exec("kill", pid.decode()).wait() == 0


def test_terminate_kills_everything(emu, app):
    sandbox = modal.Sandbox.create(app=app, timeout=300)
    long_running = sandbox.exec("sleep", "60")
    sandbox.terminate()
    sandbox.wait(raise_on_termination=False)
    assert sandbox.poll() == 137
    assert sandbox.returncode == 137
    proc = _only_exec(emu, sandbox.object_id, "sleep 60")
    assert emu.run(proc.wait(10), timeout=15)
    assert long_running.wait() == 137  # exit status of the killed exec: 128 + SIGKILL
    assert emu.sandboxes[sandbox.object_id].running_processes() == []
    with pytest.raises(modal.exception.NotFoundError):
        sandbox.exec("true")


def test_from_id_reattaches(emu, sb):
    again = modal.Sandbox.from_id(sb.object_id)
    assert again.object_id == sb.object_id
    p = again.exec("bash", "-c", "echo reattached")
    assert p.stdout.read() == "reattached\n"
    assert emu.call_count("SandboxGetCommandRouterAccess") == 1
    with pytest.raises(modal.exception.NotFoundError):
        modal.Sandbox.from_id("sb-emu-no-such-sandbox")
    # A 22-character base62 id is taken for a V1 sandbox, looked up with the V1 RPC.
    with pytest.raises(modal.exception.NotFoundError):
        modal.Sandbox.from_id("sb-" + "A" * 22)


def test_sandbox_timeout(emu, app):
    sandbox = modal.Sandbox.create(app=app, timeout=1)
    with pytest.raises(modal.exception.SandboxTimeoutError):
        sandbox.wait()
    assert sandbox.poll() == 124


def test_entrypoint_sandbox(emu, app):
    sandbox = modal.Sandbox.create(
        "bash", "-c", "echo out; echo err >&2; exit 3", app=app, timeout=60
    )
    sandbox.wait()
    assert sandbox.returncode == 3
    assert sandbox.stdout.read() == "out\n"
    assert sandbox.stderr.read() == "err\n"


def test_snapshot_filesystem_and_create_from_image(emu, app, sb):
    assert sb.exec("bash", "-c", "mkdir -p d && echo snap > d/f.txt").wait() == 0
    image = sb.snapshot_filesystem()
    assert (
        sb.exec("bash", "-c", "echo later > later.txt").wait() == 0
    )  # after the snapshot

    restored = modal.Sandbox.create(
        app=app, image=modal.Image.from_id(image.object_id), timeout=60
    )
    try:
        p = restored.exec("bash", "-c", "cat d/f.txt; ls")
        assert p.stdout.read() == "snap\nd\n"
        assert p.wait() == 0
    finally:
        restored.terminate()
    with pytest.raises(
        modal.exception.NotFoundError
    ):  # Image.from_id resolves when it is used
        modal.Sandbox.create(
            app=app, image=modal.Image.from_id("im-emu-no-such-image"), timeout=60
        )


def test_a_snapshots_files_keep_their_paths_in_each_sandbox_made_from_it(emu, app, sb):
    """As in a real image: a sandbox from a snapshot sees the files at the paths the
    snapshotted sandbox saw (its shell's cwd and $HOME hold), each sandbox its own copy."""
    p = sb.exec("bash", "-c", "mkdir -p d && echo v1 > d/f.txt && cd d && pwd && echo $HOME")
    where, home = p.stdout.read().splitlines()
    assert p.wait() == 0
    image = sb.snapshot_filesystem()
    assert sb.exec("bash", "-c", "echo v2 > d/f.txt").wait() == 0
    made = [
        modal.Sandbox.create(app=app, image=modal.Image.from_id(image.object_id), timeout=60)
        for _ in range(2)
    ]
    try:
        first, second = made
        assert first.exec("bash", "-c", "echo mine > $HOME/d/f.txt").wait() == 0
        p = second.exec("bash", "-c", f"cd {where} && pwd && echo $HOME && cat f.txt")
        assert p.stdout.read() == f"{where}\n{home}\nv1\n"
        assert p.wait() == 0
        p = first.exec("cat", "d/f.txt", workdir=home)
        assert p.stdout.read() == "mine\n"
        p = sb.exec("cat", f"{where}/f.txt")
        assert p.stdout.read() == "v2\n"  # the snapshotted sandbox's own files are untouched
        # A snapshot of a sandbox made from a snapshot keeps the same paths.
        again = modal.Sandbox.create(
            app=app, image=modal.Image.from_id(first.snapshot_filesystem().object_id), timeout=60
        )
        try:
            p = again.exec("bash", "-c", "pwd; cat d/f.txt")
            assert p.stdout.read() == f"{home}\nmine\n"
        finally:
            again.terminate()
    finally:
        for m in made:
            m.terminate()


def test_image_delete_refuses_the_image_from_then_on(emu, app, sb):
    import modal.experimental

    assert sb.exec("bash", "-c", "echo kept > f.txt").wait() == 0
    image_id = sb.snapshot_filesystem().object_id
    before = modal.Sandbox.create(app=app, image=modal.Image.from_id(image_id), timeout=60)
    try:
        modal.experimental.image_delete(image_id)
        assert image_id not in emu.images
        with pytest.raises(modal.exception.NotFoundError, match=image_id):
            modal.Sandbox.create(app=app, image=modal.Image.from_id(image_id), timeout=60)
        with pytest.raises(modal.exception.NotFoundError):
            modal.experimental.image_delete(image_id)
        p = before.exec("cat", "f.txt")  # a sandbox made before keeps running with its files
        assert p.stdout.read() == "kept\n"
    finally:
        before.terminate()


def test_filesystem_api(emu, app):
    sandbox = modal.Sandbox.create(app=app, timeout=60, workdir="/workspace")
    try:
        fs = sandbox.filesystem
        fs.write_text("hello fs\n", "/workspace/sub/a.txt")
        assert (
            emu.sandboxes[sandbox.object_id].root / "sub" / "a.txt"
        ).read_text() == "hello fs\n"
        assert fs.read_text("/workspace/sub/a.txt") == "hello fs\n"
        assert [e.name for e in fs.list_files("/workspace/sub")] == ["a.txt"]
        data = os.urandom(300_000)
        fs.write_bytes(data, "/workspace/b.bin")
        assert fs.read_bytes("/workspace/b.bin") == data
        with pytest.raises(modal.exception.SandboxFilesystemNotFoundError):
            fs.read_text("/workspace/missing")
    finally:
        sandbox.terminate()


def test_injected_errors_surface_as_sdk_exceptions(emu, app, sb):
    emu.fail_next("SandboxCreateV2", Status.PERMISSION_DENIED)
    with pytest.raises(modal.exception.PermissionDeniedError):
        modal.Sandbox.create(app=app, timeout=60)

    emu.fail_next("TaskExecStart", Status.NOT_FOUND, message="no such task")
    with pytest.raises(modal.exception.NotFoundError, match="no such task"):
        sb.exec("true")

    # Retryable statuses are retried by the SDK itself and never reach the caller.
    before = emu.call_count("TaskExecStart")
    emu.fail_next("TaskExecStart", Status.UNAVAILABLE)
    assert sb.exec("true").wait() == 0
    assert emu.call_count("TaskExecStart") == before + 2


def test_two_emulators_in_one_process():
    # The SDK's client singleton and its module-level default image outlive an emulator;
    # pointed_at() swaps the client, and the emulator accepts the stale default image id.
    for _ in range(2):
        with ModalEmulator() as emulator, pointed_at(emulator):
            app = modal.App.lookup("two-emulators", create_if_missing=True)
            sandbox = modal.Sandbox.create(app=app, timeout=60)  # default image
            p = sandbox.exec("echo", "ok")
            assert p.stdout.read() == "ok\n"
            sandbox.terminate()
    assert len(emulator.unknown_image_ids) == 1


def test_fails_fast_when_emulator_is_down():
    with ModalEmulator() as emulator:
        pass
    started = time.monotonic()
    with pytest.raises(OSError):
        emulator.assert_alive()
    assert time.monotonic() - started < 3


def test_exec_roundtrip_latency(emu, sb, record_property):
    sb.exec("true").wait()  # warm: router channel open
    samples = []
    for _ in range(50):
        t0 = time.perf_counter()
        assert sb.exec("true").wait() == 0
        samples.append(time.perf_counter() - t0)
    median = statistics.median(samples)
    record_property("exec_true_wait_median_s", median)
    print(
        f"\nexec('true')+wait over 50 runs: median {median * 1000:.1f} ms, max {max(samples) * 1000:.1f} ms"
    )
    assert median < 1.0
