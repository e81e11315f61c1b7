"""What inspect's self-checks leave out: exec_remote streaming and kill, cancel, limits, errors, connection, quoting."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inspect_ai.util import (
    ExecCompleted,
    ExecRemoteAwaitableOptions,
    ExecRemoteStreamingOptions,
    ExecStderr,
    ExecStdout,
    OutputLimitExceededError,
    SandboxUnavailableError,
)
from inspect_ai.util._sandbox.limits import override_max_exec_output_size

from hermes_env_inspect import HermesSandboxConfig, HermesSandboxEnvironment
from hermes_env_inspect.config import as_config

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def local(anyio_backend: str) -> AsyncIterator[HermesSandboxEnvironment]:
    sandbox = await HermesSandboxEnvironment.create(HermesSandboxConfig(backend="local"), task_name="provider")
    yield sandbox
    await sandbox.close()


def _alive(marker: str) -> list[int]:
    pids = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if marker in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            pids.append(p.pid)
    return pids


async def _until(predicate: Any, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.02)


async def test_exec_remote_streams_stdout_live_then_stderr_and_the_exit_code(
    local: HermesSandboxEnvironment, tmp_path: Path
) -> None:
    flag = tmp_path / "go"
    cmd = ["sh", "-c", f"echo first; echo warn >&2; while [ ! -e {flag} ]; do sleep 0.02; done; echo second; exit 7"]
    proc = await local.exec_remote(cmd, ExecRemoteStreamingOptions())
    events: list[Any] = []
    with anyio.fail_after(60):
        async for event in proc:
            events.append(event)
            stdout = "".join(e.data for e in events if isinstance(e, ExecStdout))
            if stdout.startswith("first\n") and not flag.exists():
                assert "second" not in stdout  # arrived while the command waits for the flag
                flag.touch()
    assert flag.exists()
    assert "".join(e.data for e in events if isinstance(e, ExecStdout)) == "first\nsecond\n"
    assert [e.data for e in events if isinstance(e, ExecStderr)] == ["warn\n"]
    assert isinstance(events[-1], ExecCompleted) and events[-1].exit_code == 7


async def test_exec_remote_stdout_that_looks_like_the_protocol_is_kept(local: HermesSandboxEnvironment) -> None:
    text = "HERMES-INSPECT-0123456789abcdef 0 0 - -\n.\nno newline at the end"
    result = await local.exec_remote(["printf", "%s", text], stream=False)
    assert result.stdout == text and result.returncode == 0


async def test_exec_remote_kill_stops_the_whole_tree(local: HermesSandboxEnvironment) -> None:
    marker = f"100.{random.randrange(10**8):08d}"
    proc = await local.exec_remote(["sh", "-c", f"sleep {marker} & sleep {marker}; wait"])
    await _until(lambda: len(_alive(marker)) == 2, "both sleeps")
    await proc.kill()
    assert _alive(marker) == []
    assert [e async for e in proc] == []  # killed: no ExecCompleted
    assert (await local.exec(["echo", "ok"])).stdout == "ok\n"


async def test_exec_remote_awaitable_timeout_kills(local: HermesSandboxEnvironment) -> None:
    marker = f"100.{random.randrange(10**8):08d}"
    with pytest.raises(TimeoutError):
        await local.exec_remote(["sleep", marker], ExecRemoteAwaitableOptions(timeout=1), stream=False)
    assert _alive(marker) == []
    r = await local.exec_remote(["cat"], ExecRemoteAwaitableOptions(input="in put\n"), stream=False)
    assert (r.stdout, r.returncode) == ("in put\n", 0)


async def test_cancelling_exec_kills_the_command(local: HermesSandboxEnvironment) -> None:
    marker = f"100.{random.randrange(10**8):08d}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(local.exec, ["sh", "-c", f"sleep {marker} & sleep {marker}; wait"])
        await _until(lambda: len(_alive(marker)) == 2, "both sleeps")
        tg.cancel_scope.cancel()
    assert _alive(marker) == []
    assert (await local.exec(["echo", "still usable"])).stdout == "still usable\n"


async def test_exec_output_over_the_limit_raises_with_the_tail(local: HermesSandboxEnvironment) -> None:
    with override_max_exec_output_size(1024):
        with pytest.raises(OutputLimitExceededError) as info:
            await local.exec(["sh", "-c", "seq 1 2000"])
        assert "1 KiB" in str(info.value)
        assert info.value.truncated_output is not None
        assert info.value.truncated_output.endswith("1999\n2000\n")
        assert len(info.value.truncated_output) == 1024
        ok = await local.exec(["sh", "-c", "head -c 1024 /dev/zero | tr '\\0' a"])
        assert ok.stdout == "a" * 1024


async def test_large_input_and_files_go_through_in_chunks(local: HermesSandboxEnvironment) -> None:
    blob = bytes(random.getrandbits(8) for _ in range(3 * (1 << 20) + 17))
    await local.write_file("big/blob.bin", blob)
    assert await local.read_file("big/blob.bin", text=False) == blob
    r = await local.exec(["sh", "-c", "cat > copy.bin; wc -c < copy.bin"], input=blob)
    assert r.stdout.strip() == str(len(blob))
    assert await local.read_file("copy.bin", text=False) == blob


async def test_a_closed_sandbox_is_unavailable(anyio_backend: str) -> None:
    sandbox = await HermesSandboxEnvironment.create(HermesSandboxConfig(backend="local"))
    workdir = sandbox.workdir
    assert os.path.isdir(workdir)
    await sandbox.close()
    assert not os.path.exists(workdir)
    with pytest.raises(SandboxUnavailableError, match="closed"):
        await sandbox.exec(["true"])


async def test_env_and_user_errors_are_clear(local: HermesSandboxEnvironment) -> None:
    with pytest.raises(ValueError, match="not an environment variable name: 'A B'"):
        await local.exec(["true"], env={"A B": "x"})
    with pytest.raises(ValueError, match="empty list"):
        await local.exec([])
    r = await local.exec(["definitely-not-a-command-x"])
    assert r.returncode == 127 and "not found" in r.stderr
    r = await local.exec(["pwd"], cwd="/nonexistent/dir")
    assert not r.success and "/nonexistent/dir" in r.stderr


def test_config_forms(tmp_path: Path) -> None:
    toml = tmp_path / "h.toml"
    toml.write_text('[terminal]\nenv = "local"\n')
    assert as_config(str(toml)) == HermesSandboxConfig(config_file=str(toml))
    assert as_config({"backend": "docker", "options": {"image": "x"}}).options == {"image": "x"}
    assert as_config(None) == HermesSandboxConfig()
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        as_config(str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match="workdir"):
        HermesSandboxConfig(workdir="relative/dir")
    assert hash(HermesSandboxConfig(options={"a": [1]})) == hash(HermesSandboxConfig(options={"a": [1]}))


@pytest.mark.parametrize("backend", ["local", "docker"])
async def test_connection_command_opens_a_shell_in_the_sample(backend: str, request: pytest.FixtureRequest) -> None:
    options = {"image": request.getfixturevalue("test_image")} if backend == "docker" else {}
    sandbox = await HermesSandboxEnvironment.create(HermesSandboxConfig(backend=backend, options=options))
    try:
        await sandbox.write_file("here.txt", "connected")
        conn = await sandbox.connection()
        assert conn.type == "hermes"
        # a terminal for the -it of docker exec, and for the prompt of hermes-env shell
        typed = b"cat here.txt; echo; echo END-$((40+2))\nexit\n"
        out = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                ["script", "-qec", conn.command, "/dev/null"], input=typed, capture_output=True, timeout=120
            )
        )
        text = out.stdout.decode(errors="replace")
        assert "connected" in text and "END-42" in text, text
        if backend == "docker":
            assert conn.container and conn.container in conn.command
    finally:
        await sandbox.close()


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    args=st.lists(_TEXT, min_size=1, max_size=5),
    value=_TEXT,
    name=_TEXT.map(lambda s: s.replace("/", "_")).filter(lambda s: s not in ("", ".", "..")),
)
def test_arguments_env_values_and_file_names_arrive_verbatim(
    args: list[str], value: str, name: str, tmp_path: Path
) -> None:
    sandbox = _shared_sandbox()

    async def check() -> None:
        r = await sandbox.exec(["printf", "%s\\0", *args], env={"HERMES_T": value})
        assert r.stdout.split("\0")[:-1] == args
        r = await sandbox.exec(["printenv", "HERMES_T"], env={"HERMES_T": value})
        assert r.stdout == value + "\n"
        path = f"{tmp_path}/d/{name}"
        await sandbox.write_file(path, value)
        assert await sandbox.read_file(path) == value
        assert Path(path).read_bytes().decode() == value  # read_text() would turn \r into \n

    asyncio.run(check())


_SHARED: list[HermesSandboxEnvironment] = []


def _shared_sandbox() -> HermesSandboxEnvironment:
    if not _SHARED:
        _SHARED.append(asyncio.run(HermesSandboxEnvironment.create(HermesSandboxConfig(backend="local"))))
    return _SHARED[0]


@pytest.fixture(scope="module", autouse=True)
def _close_shared() -> Any:
    yield
    while _SHARED:
        asyncio.run(_SHARED.pop().close())
