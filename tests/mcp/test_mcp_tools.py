"""The tools of ``hermes-env mcp`` through the official MCP Python SDK client, over stdio and HTTP alike."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.mcp.conftest import Connect
from tests.mcp.mcpsupport import Events, await_until, pid_alive, read_pid

pytestmark = pytest.mark.anyio


async def call(client: Any, name: str, args: dict[str, Any], **kw: Any) -> dict[str, Any]:
    r = await client.call_tool(name, args, **kw)
    assert not r.is_error, r.content
    assert isinstance(r.structured_content, dict)
    return r.structured_content


async def error(client: Any, name: str, args: dict[str, Any]) -> str:
    r = await client.call_tool(name, args)
    assert r.is_error, r
    return r.content[0].text


async def test_tools_are_listed_with_schemas(connect: Connect) -> None:
    async with connect() as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
    assert set(tools) == {"run", "spawn", "process_output", "process_wait", "process_kill", "process_list",
                          "process_write", "read_file", "write_file"}
    assert tools["run"].input_schema["required"] == ["command"]
    assert "exit_code" in tools["run"].output_schema["properties"]


async def test_state_persists_within_a_session(connect: Connect, tmp_path: Path) -> None:
    async with connect() as c:
        first = await call(c, "run", {"command": f"export GREETING=hello; f() {{ echo fn-$1; }}; cd {tmp_path}"})
        assert first["exit_code"] == 0 and first["cwd"] == str(tmp_path)
        second = await call(c, "run", {"command": "echo $GREETING; f x; pwd"})
        assert second["output"] == f"hello\nfn-x\n{tmp_path}\n"
        assert second["task_id"] == first["task_id"]
        third = await call(c, "run", {"command": "cat; exit 3", "stdin": "from stdin\n"})
        assert third["output"] == "from stdin\n" and third["exit_code"] == 3


async def test_timeout_exits_124(connect: Connect) -> None:
    async with connect() as c:
        r = await call(c, "run", {"command": "echo started; sleep 30", "timeout": 0.5})
        assert r["exit_code"] == 124 and r["timed_out"] is True
        assert "started" in r["output"]
        assert any("timed out" in n for n in r["notes"])
        after = await call(c, "run", {"command": "echo still here"})
        assert after["output"] == "still here\n"


async def test_cancel_kills_the_command_and_reports_130(connect: Connect, tmp_path: Path) -> None:
    events = Events()
    pidfile = tmp_path / "cancel.pid"
    async with connect(events=events) as c:
        async with anyio.create_task_group() as tg:

            async def long_call() -> None:
                await c.call_tool("run", {"command": f"sh -c 'echo $$ > {pidfile}.t && mv {pidfile}.t {pidfile}; exec sleep 300'"})

            tg.start_soon(long_call)
            await await_until(lambda: read_pid(pidfile) is not None, what="the command to start")
            pid = read_pid(pidfile)
            assert pid is not None and pid_alive(pid)
            tg.cancel_scope.cancel()
        await await_until(lambda: not pid_alive(pid), what=f"pid {pid} to end after cancel")
        cancelled = await events.wait_for(lambda d: d.get("event") == "cancelled")
        assert cancelled["exit_code"] == 130
        after = await call(c, "run", {"command": "echo alive"})
        assert after["output"] == "alive\n"


async def test_progress_notifications_carry_the_output_so_far(connect: Connect, tmp_path: Path) -> None:
    seen: list[tuple[float, str | None]] = []
    go = tmp_path / "go"

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, message))
        if message and "first-line" in message:
            go.touch()  # the command goes on only once its first line was reported

    async with connect() as c:
        r = await call(c, "run", {"command": f"echo first-line; until [ -e {go} ]; do sleep 0.05; done; echo second-line",
                                  "timeout": 30}, progress_callback=on_progress)
    assert r["output"] == "first-line\nsecond-line\n" and r["exit_code"] == 0
    messages = [m for _, m in seen]
    assert any(m is not None and "first-line" in m and "second-line" not in m for m in messages), seen
    values = [p for p, _ in seen]
    assert values == sorted(values) and len(set(values)) == len(values)


async def test_background_flow(connect: Connect) -> None:
    events = Events()
    async with connect(events=events) as c:
        started = await call(c, "spawn", {
            "command": "echo booting; while read line; do echo got:$line; [ \"$line\" = ready ] && echo SERVER READY; done; exit 7",
            "watch": ["SERVER READY"],
        })
        pid = started["id"]
        assert started["status"] == "running" and started["pid"]
        waited = await call(c, "process_wait", {"id": pid, "timeout": 0.3})
        assert waited["event"] == "timeout"
        await call(c, "process_write", {"id": pid, "data": "hello\nready\n"})
        waited = await call(c, "process_wait", {"id": pid, "timeout": 20})
        assert waited["event"] == "match"
        assert waited["matches"][0]["line"].strip() == "SERVER READY"
        match = await events.wait_for(lambda d: d.get("event") == "match" and d.get("process_id") == pid)
        assert match["pattern"] == "SERVER READY"
        out = await call(c, "process_output", {"id": pid})
        assert out["output"] == "booting\ngot:hello\ngot:ready\nSERVER READY\n"
        more = await call(c, "process_output", {"id": pid, "since": out["next_offset"]})
        assert more["output"] == ""
        listed = await call(c, "process_list", {})
        assert [p["id"] for p in listed["processes"]] == [pid]
        await call(c, "process_write", {"id": pid, "data": "", "close_stdin": True})
        waited = await call(c, "process_wait", {"id": pid, "timeout": 20})
        assert waited["event"] == "exit" and waited["exit_code"] == 7
        exited = await events.wait_for(lambda d: d.get("event") == "exit" and d.get("process_id") == pid)
        assert exited["exit_code"] == 7

        sleeper = await call(c, "spawn", {"command": "sleep 300"})
        killed = await call(c, "process_kill", {"id": sleeper["id"]})
        assert killed["status"] == "killed"
        assert not pid_alive(sleeper["pid"])


async def test_session_end_kills_its_background_processes(connect: Connect) -> None:
    async with connect() as c:
        started = await call(c, "spawn", {"command": "sleep 300"})
    await await_until(lambda: not pid_alive(started["pid"]), what="the background process to end with its session")


async def test_files(connect: Connect, tmp_path: Path) -> None:
    async with connect() as c:
        await call(c, "run", {"command": f"cd {tmp_path}"})
        w = await call(c, "write_file", {"path": "sub/dir/a.txt", "content": "héllo\n", "make_dirs": True})
        assert w["bytes_written"] == len("héllo\n".encode())
        assert (tmp_path / "sub/dir/a.txt").read_text() == "héllo\n"
        await call(c, "write_file", {"path": "sub/dir/a.txt", "content": "more\n", "append": True})
        r = await call(c, "read_file", {"path": "sub/dir/a.txt"})
        assert r["encoding"] == "utf-8" and r["content"] == "héllo\nmore\n" and r["truncated"] is False

        blob = bytes(range(256)) * 4
        await call(c, "write_file", {"path": "b.bin", "content": base64.b64encode(blob).decode(), "encoding": "base64"})
        assert (tmp_path / "b.bin").read_bytes() == blob
        r = await call(c, "read_file", {"path": "b.bin", "offset": 120, "max_bytes": 100})
        assert r["encoding"] == "base64" and base64.b64decode(r["content"]) == blob[120:220]
        assert r["size"] == len(blob) and r["truncated"] is True

        assert "no such file" in await error(c, "read_file", {"path": "missing.txt"})
        assert "is a directory" in await error(c, "read_file", {"path": "sub"})
        text = await error(c, "write_file", {"path": "nodir/x.txt", "content": "x"})
        assert "nodir/x.txt" in text and "No such file" in text
        # The agent's shell is unchanged by file tools.
        r = await call(c, "run", {"command": "pwd"})
        assert r["output"] == f"{tmp_path}\n"


async def test_errors_are_tool_errors(connect: Connect) -> None:
    async with connect() as c:
        assert "argument 'timeout'" in await error(c, "run", {"command": "true", "timeout": "soon"})
        assert "'command' is a required property" in await error(c, "run", {})
        assert "unknown argument(s) 'comand'" in await error(c, "run", {"comand": "ls"})
        assert "no background process 'bg-nope'" in await error(c, "process_output", {"id": "bg-nope"})
        assert "unknown tool 'nope'" in await error(c, "nope", {})
        assert "not a valid regex" in await error(c, "spawn", {"command": "true", "watch_regex": ["("]})
        # The server is still there.
        assert (await call(c, "run", {"command": "echo ok"}))["output"] == "ok\n"


async def test_run_reports_usage_and_end_reason(connect: Connect) -> None:
    async with connect() as c:
        r = await call(c, "run", {"command": "for ((i = 0; i < 20000; i++)); do :; done; exit 3"})
        assert (r["exit_code"], r["end_reason"], r["signal"]) == (3, "exited", None)
        u = r["usage"]
        assert set(u) == {"cpu_user_s", "cpu_system_s", "max_rss_bytes", "oom_killed"}
        assert u["cpu_user_s"] is not None and u["cpu_user_s"] + u["cpu_system_s"] > 0
        r = await call(c, "run", {"command": "sleep 5", "timeout": 0.3})
        assert r["end_reason"] == "timed_out"
        r = await call(c, "run", {"command": "kill -9 $$"})
        assert (r["exit_code"], r["end_reason"], r["signal"]) == (137, "signaled", 9)
