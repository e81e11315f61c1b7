"""hermes_env_core.aio on the local backend: execute, stream, cancel (whole tree), async with, concurrency."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hermes_env_core import ConfigError, EnvironmentClosedError, ExecResult
from hermes_env_core.aio import AsyncEnvironment, create_environment, run_in_thread


def run(coro: Any, timeout: float = 60) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def _procs_with(arg: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if arg in (p.info["cmdline"] or []):
            found.append(p)
    return found


async def _until(predicate: Any, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_execute_keeps_the_session_and_returns_exec_result(tmp_path: Path) -> None:
    async def main() -> None:
        async with await create_environment("local") as env:
            assert isinstance(env, AsyncEnvironment)
            await env.execute(f"cd {tmp_path} && export GREETING=hi && f() {{ echo fn-$1; }}")
            r = await env.execute("pwd; echo $GREETING; f x; exit 3")
            assert isinstance(r, ExecResult)
            assert r.output == f"{tmp_path}\nhi\nfn-x\n"
            assert r.exit_code == 3
            assert r.cwd == str(tmp_path)
            r = await env.execute("cat", stdin=b"in\x00put")
            assert r.output == "in\x00put"
            r = await env.execute("sleep 5", timeout=0.5)
            assert r.timed_out and r.exit_code == 124
        assert env.closed
        with pytest.raises(EnvironmentClosedError):
            await env.execute("true")

    run(main())


def test_stream_yields_output_while_the_command_runs(tmp_path: Path) -> None:
    flag = tmp_path / "go"

    async def main() -> None:
        async with await create_environment("local") as env:
            chunks: list[str] = []
            stream = env.stream(f"echo first; while [ ! -e {flag} ]; do sleep 0.02; done; echo second; exit 4")
            with pytest.raises(RuntimeError, match="not finished"):
                _ = stream.result
            async for chunk in stream:
                chunks.append(chunk)
                if "first" in "".join(chunks) and not flag.exists():
                    # the command is still waiting for the flag: this chunk came live
                    assert "second" not in "".join(chunks)
                    flag.touch()
            assert flag.exists()
            assert "".join(chunks) == "first\nsecond\n"
            assert stream.result.exit_code == 4
            assert stream.result.output == "first\nsecond\n"

    run(main())


def test_cancelling_the_task_kills_the_whole_tree_and_the_session_stays_usable() -> None:
    marker = f"100.{random.randrange(10**8):08d}"

    async def main() -> None:
        async with await create_environment("local") as env:
            await env.execute("cd / && export KEPT=yes")
            # a child and a grandchild in a subshell: the whole tree must go
            task = asyncio.create_task(env.execute(f"(sleep {marker} & sleep {marker}; wait) ; echo never"))
            await _until(lambda: len(_procs_with(marker)) == 2, "both sleeps to start")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # execute() returned before CancelledError was raised: nothing is left, no waiting needed
            assert [p.pid for p in _procs_with(marker) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
            r = await env.execute("echo ok; echo $KEPT; pwd")
            assert r.output == "ok\nyes\n/\n"
            assert r.exit_code == 0

    run(main())


def test_cancelling_a_stream_consumer_stops_the_command() -> None:
    marker = f"100.{random.randrange(10**8):08d}"

    async def main() -> None:
        async with await create_environment("local") as env:
            seen: list[str] = []

            async def consume() -> None:
                async for chunk in env.stream(f"echo started; sleep {marker}"):
                    seen.append(chunk)

            task = asyncio.create_task(consume())
            await _until(lambda: bool(_procs_with(marker)) and seen == ["started\n"], "the stream to start")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert [p for p in _procs_with(marker) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
            async with env.stream(f"sleep {marker}") as s:
                it = s.__aiter__()
                next_chunk = asyncio.create_task(it.__anext__())
                await _until(lambda: bool(_procs_with(marker)), "the second sleep")
            # leaving the block stopped it
            assert [p for p in _procs_with(marker) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
            next_chunk.cancel()
            assert (await env.execute("echo ok")).output == "ok\n"

    run(main())


def test_sessions_driven_from_many_tasks_run_at_once(tmp_path: Path) -> None:
    n = 6

    async def main() -> None:
        envs = list(await asyncio.gather(*(create_environment("local") for _ in range(n))))
        try:
            # each command waits until all n have started: only concurrent execution ends
            cmd = "touch {d}/$X; until [ $(ls {d} | wc -l) -ge {n} ]; do sleep 0.02; done; echo $X"
            results = await asyncio.gather(
                *(env.execute(f"X={i}; " + cmd.format(d=tmp_path, n=n), timeout=30) for i, env in enumerate(envs))
            )
            assert [r.output for r in results] == [f"{i}\n" for i in range(n)]
            assert all(not r.timed_out for r in results)
        finally:
            await asyncio.gather(*(env.close() for env in envs))

    run(main())


def test_many_tasks_on_one_session_take_turns_as_in_one_shell(tmp_path: Path) -> None:
    n = 8

    async def main() -> None:
        async with await create_environment("local") as env:
            await env.execute("N=0")
            # one shell runs one command at a time: every increment sees the one before it, none is lost
            step = f"N=$((N+1)); echo $N >> {tmp_path}/seen; echo $N"
            results = await asyncio.gather(*(env.execute(step, timeout=30) for _ in range(n)))
            assert sorted(int(r.output) for r in results) == list(range(1, n + 1))
            assert (await env.execute("echo $N")).output == f"{n}\n"
            assert sorted(int(x) for x in (tmp_path / "seen").read_text().split()) == list(range(1, n + 1))

    run(main())


def test_create_environment_rejects_bad_options_like_the_sync_api() -> None:
    async def main() -> None:
        with pytest.raises(ConfigError, match="no_such_option"):
            await create_environment("local", no_such_option=1)

    run(main())


def test_run_in_thread_waits_for_the_call_when_cancelled() -> None:
    import threading

    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def blocking() -> None:
        started.set()
        release.wait(10)
        finished.set()

    async def main() -> None:
        task = asyncio.create_task(run_in_thread(blocking))
        await _until(started.is_set, "the call to start")
        task.cancel()
        await asyncio.sleep(0)
        assert not task.done()  # still waiting for the thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()

    run(main())
