"""The official ``daytona`` SDK, unmodified, against the local emulator in ``emulator/``.

Nothing here mocks or patches the SDK: it is pointed at the emulator through
``DaytonaConfig(api_url=..., api_key=...)`` (or ``DAYTONA_API_URL`` /
``DAYTONA_API_KEY``) and every call crosses real HTTP on 127.0.0.1.  These
tests pin down the emulator's fidelity so the Daytona backend's own tests can
lean on it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import statistics
import sys
import time
from pathlib import Path

import pytest

# A missing SDK must fail loudly (DESIGN.md: absent components fail, never skip).
from daytona import (
    AsyncDaytona,
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaAuthenticationError,
    DaytonaConfig,
    DaytonaError,
    DaytonaForbiddenError,
    DaytonaInternalServerError,
    DaytonaNotFoundError,
    DaytonaRateLimitError,
    FileDownloadRequest,
    FileUpload,
    ListSandboxesQuery,
    Resources,
    SandboxState,
    SessionExecuteRequest,
)
from daytona.common.errors import (
    DaytonaBadRequestError,
    DaytonaFileAccessDeniedError,
    DaytonaFileNotFoundError,
    DaytonaTimeoutError,
)


def _load_emulator():
    """Import ``emulator/`` under a private name, whatever pytest's import mode or rootdir."""
    name = "hermes_env_daytona_tests_emulator"
    if name in sys.modules:
        return sys.modules[name]
    pkg_dir = Path(__file__).resolve().parent / "emulator"
    spec = importlib.util.spec_from_file_location(
        name, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


DaytonaEmulator = _load_emulator().DaytonaEmulator


@pytest.fixture
def emu(monkeypatch):
    # Loopback only: never let a proxy setting route 127.0.0.1 elsewhere.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with DaytonaEmulator() as emulator:
        yield emulator


@pytest.fixture
def client(emu):
    return Daytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key))


@pytest.fixture
def sandbox(client):
    return client.create(CreateSandboxFromSnapshotParams(labels={"suite": "emulator"}))


def _requests(emu, method, path_suffix):
    return [r for r in emu.requests if r.method == method and r.path.endswith(path_suffix)]


# --------------------------------------------------------------------- lifecycle
def test_create_with_labels_name_and_auto_stop(emu, client):
    sb = client.create(
        CreateSandboxFromSnapshotParams(
            name="labelled-1", snapshot="my-snapshot", labels={"team": "hermes", "run": "7"}, auto_stop_interval=0
        )
    )
    assert sb.state == SandboxState.STARTED
    assert sb.name == "labelled-1"
    assert sb.snapshot == "my-snapshot"
    assert sb.auto_stop_interval == 0
    assert sb.labels["team"] == "hermes" and sb.labels["run"] == "7"
    record = emu.sandboxes[sb.id]
    assert record.labels["team"] == "hermes"
    # The SDK adds its language label on every create.
    assert record.labels["code-toolbox-language"] == "python"
    assert record.root.is_dir()


def test_create_from_image_with_resources(emu, client):
    sb = client.create(
        CreateSandboxFromImageParams(image="python:3.12-slim", resources=Resources(cpu=2, memory=4, disk=8))
    )
    assert (sb.cpu, sb.memory, sb.disk) == (2, 4, 8)
    assert sb.snapshot == "python:3.12-slim"
    assert "FROM python:3.12-slim" in emu.sandboxes[sb.id].dockerfile
    assert sb.build_info is not None and "python:3.12-slim" in sb.build_info.dockerfile_content


def test_get_by_id_and_by_name(client):
    created = client.create(CreateSandboxFromSnapshotParams(name="by-name"))
    assert client.get(created.id).name == "by-name"
    assert client.get("by-name").id == created.id
    with pytest.raises(DaytonaNotFoundError):
        client.get("no-such-sandbox")


def test_duplicate_name_is_a_conflict(client):
    client.create(CreateSandboxFromSnapshotParams(name="twin"))
    with pytest.raises(DaytonaError) as info:
        client.create(CreateSandboxFromSnapshotParams(name="twin"))
    assert info.value.status_code == 409


def test_list_filters_by_labels_and_pages(client):
    a = client.create(CreateSandboxFromSnapshotParams(labels={"pool": "a", "tier": "1"}))
    b = client.create(CreateSandboxFromSnapshotParams(labels={"pool": "a", "tier": "2"}))
    client.create(CreateSandboxFromSnapshotParams(labels={"pool": "b"}))
    assert {s.id for s in client.list(ListSandboxesQuery(labels={"pool": "a"}))} == {a.id, b.id}
    assert [s.id for s in client.list(ListSandboxesQuery(labels={"pool": "a", "tier": "2"}))] == [b.id]
    assert list(client.list(ListSandboxesQuery(labels={"pool": "none"}))) == []
    # limit is a page size: the SDK follows nextCursor until every match is seen.
    assert len(list(client.list(ListSandboxesQuery(limit=1)))) == 3


def test_stop_then_start(emu, sandbox):
    sandbox.stop()
    assert sandbox.state == SandboxState.STOPPED
    assert emu.sandboxes[sandbox.id].state == "stopped"
    with pytest.raises(DaytonaBadRequestError):
        sandbox.process.exec("true")
    sandbox.start()
    assert sandbox.state == SandboxState.STARTED
    assert sandbox.process.exec("echo back").result == "back\n"


def test_stop_kills_running_processes(emu, sandbox):
    sandbox.process.create_session("bg")
    started = sandbox.process.execute_session_command("bg", SessionExecuteRequest(command="sleep 60", run_async=True))
    assert started.cmd_id
    assert len(emu.sandboxes[sandbox.id].processes) >= 1
    sandbox.stop()
    assert len(emu.sandboxes[sandbox.id].processes) == 0


def test_archive_then_start(sandbox):
    sandbox.stop()
    sandbox.archive()
    sandbox.refresh_data()
    assert sandbox.state == SandboxState.ARCHIVED
    sandbox.start()
    assert sandbox.state == SandboxState.STARTED


def test_delete(emu, client):
    sb = client.create(CreateSandboxFromSnapshotParams(name="doomed"))
    root = emu.sandboxes[sb.id].root
    client.delete(sb)
    assert sb.id not in emu.sandboxes
    assert not root.exists()
    with pytest.raises(DaytonaNotFoundError):
        client.get(sb.id)
    other = client.create(CreateSandboxFromSnapshotParams())
    other.delete(wait=True)
    assert other.state == SandboxState.DESTROYED


def test_ephemeral_sandbox_is_destroyed_on_stop(emu, client):
    sb = client.create(CreateSandboxFromSnapshotParams(ephemeral=True))
    sb.stop()
    assert sb.state in (SandboxState.DESTROYED, SandboxState.STOPPED)
    assert sb.id not in emu.sandboxes


def test_state_waits_follow_pushed_events(emu, client):
    """With a transition delay the SDK must wait; the pushed Socket.IO event ends the wait."""
    sb = client.create(CreateSandboxFromSnapshotParams())
    assert emu.events.wait_connected(1, timeout=10)
    emu.transition_delay = 0.3
    t0 = time.monotonic()
    sb.stop()
    stop_s = time.monotonic() - t0
    assert sb.state == SandboxState.STOPPED
    sb.start()
    assert sb.state == SandboxState.STARTED
    # The SDK's polling fallback is 1 s; an event-driven wait ends at the transition.
    assert 0.3 <= stop_s < 0.95


def test_state_waits_fall_back_to_polling_without_events(emu):
    emu.events.enabled = False
    client = Daytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key))
    emu.transition_delay = 0.2
    sb = client.create(CreateSandboxFromSnapshotParams())
    assert sb.state == SandboxState.STARTED
    sb.stop()
    assert sb.state == SandboxState.STOPPED
    assert emu.events.connected == 0


def test_toolbox_url_fetched_from_the_control_plane_when_not_in_the_dto(emu, client):
    emu.advertise_toolbox_url = False
    sb = client.create()
    assert sb.toolbox_proxy_url == emu.toolbox_url
    assert _requests(emu, "GET", f"/api/sandbox/{sb.id}/toolbox-proxy-url")
    assert sb.process.exec("echo via-fetched-url").result == "via-fetched-url\n"


def test_config_from_environment(emu, monkeypatch):
    for key, value in emu.sdk_env().items():
        monkeypatch.setenv(key, value)
    sb = Daytona().create()
    assert sb.process.exec("echo env-config").result == "env-config\n"


# -------------------------------------------------------------------------- exec
def test_exec_echo_and_exit_codes(sandbox):
    out = sandbox.process.exec("echo hello")
    assert (out.exit_code, out.result) == (0, "hello\n")
    assert out.artifacts.stdout == "hello\n"
    assert sandbox.process.exec("exit 3").exit_code == 3
    merged = sandbox.process.exec("echo out; echo err >&2; false")
    assert merged.exit_code == 1
    assert merged.result == "out\nerr\n"
    assert sandbox.process.exec("printf 'a b\\n' | wc -w").result.strip() == "2"


def test_exec_cwd(sandbox):
    home = sandbox.get_user_home_dir()
    assert sandbox.get_work_dir() == home
    assert sandbox.process.exec("pwd").result == f"{home}\n"
    sandbox.fs.create_folder("sub/dir", "755")
    assert sandbox.process.exec("pwd", cwd="sub/dir").result == f"{home}/sub/dir\n"
    assert sandbox.process.exec("pwd", cwd=f"{home}/sub").result == f"{home}/sub\n"
    missing = sandbox.process.exec("pwd", cwd="nope")
    assert missing.exit_code == -1 and "no such file or directory" in missing.result
    with pytest.raises(DaytonaFileAccessDeniedError):
        sandbox.process.exec("pwd", cwd="/")


def test_exec_env(client):
    sb = client.create(CreateSandboxFromSnapshotParams(env_vars={"FROM_CREATE": "c1", "SHARED": "create"}))
    out = sb.process.exec('echo "$FROM_CREATE $FROM_CALL $SHARED $HOME"', env={"FROM_CALL": "x y", "SHARED": "call"})
    assert out.result == f"c1 x y call {sb.get_user_home_dir()}\n"
    # The runner's own environment does not leak into the sandbox.
    assert sb.process.exec("echo ${PYTEST_CURRENT_TEST:-unset}").result == "unset\n"


def test_exec_timeout_kills_the_process_group(sandbox):
    home = Path(sandbox.get_user_home_dir())
    t0 = time.monotonic()
    # The daemon's 408 carries common-go's REQUEST_TIMEOUT, which the SDK maps by status only.
    with pytest.raises(DaytonaTimeoutError) as info:
        sandbox.process.exec("sleep 30 & echo $! > child.pid; wait", timeout=1)
    assert time.monotonic() - t0 < 10
    assert info.value.status_code == 408
    assert info.value.code == "REQUEST_TIMEOUT"
    child = int((home / "child.pid").read_text())
    stat = Path(f"/proc/{child}/stat")
    # Killed before the 408 was sent: gone, or a zombie awaiting its reaper.
    assert not stat.exists() or stat.read_text().split(") ", 1)[1].startswith("Z")
    assert sandbox.process.exec("echo still-usable").exit_code == 0


def test_exec_true_latency(sandbox, capsys):
    for _ in range(5):
        sandbox.process.exec("true")
    samples = []
    for _ in range(100):
        t0 = time.perf_counter()
        assert sandbox.process.exec("true").exit_code == 0
        samples.append(time.perf_counter() - t0)
    median_ms = statistics.median(samples) * 1000
    with capsys.disabled():
        print(
            f"\n[emulator] median of 100 sandbox.process.exec('true'): {median_ms:.2f} ms "
            f"(p90 {statistics.quantiles(samples, n=10)[-1] * 1000:.2f} ms)"
        )
    assert median_ms < 500


def test_sessions_keep_shell_state(sandbox):
    sandbox.process.create_session("s1")
    sandbox.fs.create_folder("work", "755")
    first = sandbox.process.execute_session_command("s1", SessionExecuteRequest(command="cd work && export X=42"))
    assert first.exit_code == 0
    second = sandbox.process.execute_session_command("s1", SessionExecuteRequest(command="pwd; echo $X; echo e >&2"))
    assert second.exit_code == 0
    assert second.stdout == f"{sandbox.get_user_home_dir()}/work\n42\n"
    assert second.stderr == "e\n"
    failing = sandbox.process.execute_session_command("s1", SessionExecuteRequest(command="(exit 7)"))
    assert failing.exit_code == 7
    queued = sandbox.process.execute_session_command("s1", SessionExecuteRequest(command="echo later", run_async=True))
    # A sync command in the same session runs after the async one, so this also waits for it.
    sandbox.process.execute_session_command("s1", SessionExecuteRequest(command="true"))
    assert sandbox.process.get_session_command("s1", queued.cmd_id).exit_code == 0
    assert sandbox.process.get_session_command_logs("s1", queued.cmd_id).stdout == "later\n"
    assert [c.command for c in sandbox.process.get_session("s1").commands][:2] == [
        "cd work && export X=42",
        "pwd; echo $X; echo e >&2",
    ]
    assert [s.session_id for s in sandbox.process.list_sessions()] == ["s1"]
    sandbox.process.delete_session("s1")
    with pytest.raises(DaytonaNotFoundError):
        sandbox.process.get_session("s1")


# ------------------------------------------------------------------------- files
def test_upload_many_files_in_one_call_then_download(emu, sandbox):
    home = sandbox.get_user_home_dir()
    files = {f"batch/{i // 10}/f{i}.txt": f"file {i}\n".encode() for i in range(40)}
    files["batch/binary.bin"] = bytes(range(256)) * 64
    files[f"{home}/absolute.txt"] = b"absolute path inside home"
    files["batch/unicode-\u00e9\u00e8 name.txt"] = "h\u00e9llo".encode()
    before = len(_requests(emu, "POST", "/files/bulk-upload"))
    sandbox.fs.upload_files([FileUpload(source=data, destination=path) for path, data in files.items()])
    assert len(_requests(emu, "POST", "/files/bulk-upload")) == before + 1

    root = emu.sandboxes[sandbox.id].root
    assert (root / "batch/3/f35.txt").read_bytes() == b"file 35\n"
    assert (root / "absolute.txt").read_bytes() == b"absolute path inside home"
    for path, data in files.items():
        assert sandbox.fs.download_file(path) == data
    # The same files in one bulk download.
    results = sandbox.fs.download_files([FileDownloadRequest(source=p) for p in files])
    assert {r.source: r.result for r in results} == files
    # And visible to commands at the same paths.
    assert sandbox.process.exec("cat batch/0/f3.txt absolute.txt").result == "file 3\nabsolute path inside home"


def test_upload_file_from_local_path_and_download_to_local_path(sandbox, tmp_path):
    local = tmp_path / "local.txt"
    local.write_bytes(b"from disk")
    sandbox.fs.upload_file(str(local), "copied/local.txt")
    sandbox.fs.upload_file(b"overwritten", "copied/local.txt")
    target = tmp_path / "back.txt"
    sandbox.fs.download_file("copied/local.txt", str(target))
    assert target.read_bytes() == b"overwritten"


def test_download_errors(sandbox):
    with pytest.raises(DaytonaFileNotFoundError):
        sandbox.fs.download_file("missing.txt")
    results = sandbox.fs.download_files([FileDownloadRequest(source="missing.txt")])
    assert results[0].result is None and "not found" in results[0].error
    assert results[0].error_details.code == "FILE_NOT_FOUND"


def test_paths_outside_the_sandbox_are_refused(emu, sandbox):
    # /tmp is the sandbox's too (the daemon's file API reaches its whole filesystem) ...
    scratch = f"/tmp/daytona-emulator-tmp-{sandbox.id}"
    sandbox.fs.upload_file(b"t", f"{scratch}/f")
    assert Path(scratch, "f").read_bytes() == b"t"
    shutil.rmtree(scratch)
    # ... but not the emulator's tree, where the other sandboxes live.
    with pytest.raises(DaytonaFileAccessDeniedError):
        sandbox.fs.create_folder(str(emu.root / "elsewhere"), "755")
    with pytest.raises(DaytonaError) as info:
        sandbox.fs.upload_file(b"x", "../escape.txt")
    assert info.value.status_code == 403
    with pytest.raises(DaytonaFileAccessDeniedError):
        sandbox.fs.download_file("/etc/hostname")
    (emu.sandboxes[sandbox.id].root / "link").symlink_to("/etc")
    with pytest.raises(DaytonaFileAccessDeniedError):
        sandbox.fs.download_file("link/hostname")
    assert not Path("/tmp/daytona-emulator-escape").exists()


def test_create_folder_and_delete_file(emu, sandbox):
    root = emu.sandboxes[sandbox.id].root
    sandbox.fs.create_folder("made/here", "700")
    assert (root / "made/here").is_dir()
    assert oct((root / "made/here").stat().st_mode & 0o777) == "0o700"
    sandbox.fs.upload_file(b"bye", "made/here/file.txt")
    info = sandbox.fs.get_file_info("made/here/file.txt")
    assert (info.size, info.is_dir) == (3, False)
    sandbox.fs.delete_file("made/here/file.txt")
    assert not (root / "made/here/file.txt").exists()
    with pytest.raises(DaytonaError):
        sandbox.fs.delete_file("made")  # a directory needs recursive=True
    sandbox.fs.delete_file("made", recursive=True)
    assert not (root / "made").exists()
    with pytest.raises(DaytonaNotFoundError):
        sandbox.fs.delete_file("made")


def test_home_dir_calls(sandbox):
    home = sandbox.get_user_home_dir()
    with pytest.warns(DeprecationWarning):
        assert sandbox.get_user_root_dir() == home
    assert Path(home).is_dir()


# ------------------------------------------------------------- failure injection
def test_wrong_api_key_is_rejected_with_401(emu):
    bad = Daytona(DaytonaConfig(api_url=emu.api_url, api_key="not-the-key"))
    with pytest.raises(DaytonaAuthenticationError) as info:
        bad.create()
    assert info.value.status_code == 401
    with pytest.raises(DaytonaAuthenticationError):
        bad.get("anything")
    assert emu.sandboxes == {}


def test_toolbox_calls_check_the_key_too(emu, sandbox):
    emu.api_key = "rotated"
    with pytest.raises(DaytonaAuthenticationError):
        sandbox.process.exec("true")


def test_injected_500_surfaces_as_internal_server_error(emu, client, sandbox):
    emu.fail_next(500, path="/process/execute$")
    with pytest.raises(DaytonaInternalServerError) as info:
        sandbox.process.exec("true")
    assert info.value.status_code == 500
    assert sandbox.process.exec("true").exit_code == 0  # only the next call failed

    emu.fail_next(500, method="GET", path=r"^/api/sandbox/")
    with pytest.raises(DaytonaInternalServerError):
        client.get(sandbox.id)
    assert client.get(sandbox.id).id == sandbox.id


def test_injected_429_on_create(emu, client):
    emu.fail_next(429, method="POST", path=r"^/api/sandbox$", times=2)
    for _ in range(2):
        with pytest.raises(DaytonaRateLimitError) as info:
            client.create()
        assert info.value.status_code == 429
        assert info.value.headers.get("Retry-After") == "1"
    assert emu.sandboxes == {}
    client.create()
    assert len(emu.sandboxes) == 1


def test_cpu_quota_on_create(emu, client):
    emu.max_total_cpu = 2
    client.create(CreateSandboxFromImageParams(image="debian:12", resources=Resources(cpu=2)))
    with pytest.raises(DaytonaForbiddenError, match="Total CPU limit exceeded"):
        client.create(CreateSandboxFromImageParams(image="debian:12", resources=Resources(cpu=1)))


def test_sandbox_forced_into_error_state(emu, sandbox):
    emu.force_state(sandbox.id, "error", reason="disk failure")
    sandbox.refresh_data()
    assert sandbox.state == SandboxState.ERROR
    assert sandbox.error_reason == "disk failure"
    with pytest.raises(DaytonaError, match="entered error state"):
        sandbox.wait_for_sandbox_start(timeout=5)
    with pytest.raises(DaytonaBadRequestError):
        sandbox.process.exec("true")
    with pytest.raises(DaytonaBadRequestError):
        sandbox.start()
    emu.force_state(sandbox.id, "error", reason="transient", recoverable=True)
    sandbox.recover()
    assert sandbox.state == SandboxState.STARTED


def test_create_that_lands_in_error_state(emu, client):
    emu.create_next_in_state("error", reason="no runner available")
    with pytest.raises(DaytonaError, match="no runner available"):
        client.create(timeout=10)
    (record,) = emu.sandboxes.values()
    assert record.state == "error"


# ---------------------------------------------------------------------- async SDK
def test_async_client_uses_the_same_routes(emu):
    async def scenario():
        async with AsyncDaytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key)) as adaytona:
            sb = await adaytona.create(CreateSandboxFromSnapshotParams(name="async-1", labels={"mode": "async"}))
            out = await sb.process.exec("echo async; exit 4", cwd=None, env={"A": "1"})
            await sb.fs.upload_files(
                [FileUpload(source=b"one", destination="a/1.txt"), FileUpload(source=b"two", destination="a/2.txt")]
            )
            data = await sb.fs.download_file("a/2.txt")
            listed = [s.id async for s in adaytona.list(ListSandboxesQuery(labels={"mode": "async"}))]
            await sb.stop()
            await sb.start()
            got = await adaytona.get("async-1")
            await adaytona.delete(got)
            return sb.id, out.exit_code, out.result, data, listed

    sid, code, result, data, listed = asyncio.run(scenario())
    assert (code, result, data, listed) == (4, "async\n", b"two", [sid])
    assert sid not in emu.sandboxes
    routes = {(r.method, r.path.replace(sid, "{id}")) for r in emu.requests}
    assert ("POST", "/api/sandbox") in routes
    assert ("POST", "/toolbox/{id}/process/execute") in routes
    assert ("POST", "/toolbox/{id}/files/bulk-upload") in routes
    assert ("POST", "/toolbox/{id}/files/bulk-download") in routes
    assert ("POST", "/api/sandbox/{id}/stop") in routes
    assert ("DELETE", "/api/sandbox/{id}") in routes


# --------------------------------------------------------------------- emulator
def test_emulator_shuts_down_cleanly(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with DaytonaEmulator() as emu:
        client = Daytona(DaytonaConfig(api_url=emu.api_url, api_key=emu.api_key))
        sb = client.create()
        sb.process.create_session("s")
        sb.process.execute_session_command("s", SessionExecuteRequest(command="sleep 60", run_async=True))
        record = emu.sandboxes[sb.id]
        root = emu.root
        assert len(record.processes) >= 1
    assert len(record.processes) == 0
    assert not root.exists()
    with pytest.raises(DaytonaError):
        sb.process.exec("true")
