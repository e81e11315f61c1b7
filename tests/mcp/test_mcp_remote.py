"""hermes-env mcp on remote targets: a real Docker engine and a real sshd. The tools, files included, work
inside the target, and a container goes with its MCP session."""

from __future__ import annotations

import base64
from pathlib import Path

import anyio
import pytest

from hermes_env_core.backends._docker_reaper import LABEL_TASK
from tests.mcp.mcpsupport import stdio_client
from tests.support.docker_engine import ensure_engine, ensure_test_image

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


async def test_tools_inside_a_container(tmp_path: Path) -> None:
    client = ensure_engine()
    image = ensure_test_image(client)
    args = ("--env", "docker", "-o", f"image={image}", "-o", "pids_limit=128", "-o", "memory=512m")
    async with stdio_client(tmp_path, *args) as c:
        r = await c.call_tool("run", {"command": "mkdir -p /tmp/w && cd /tmp/w && export IN=container; hostname"})
        assert not r.is_error, r.content
        task_id = r.structured_content["task_id"]
        containers = client.containers.list(filters={"label": f"{LABEL_TASK}={task_id}"})
        assert len(containers) == 1

        blob = bytes(range(256)) * 64
        w = await c.call_tool("write_file", {"path": "data.bin", "content": base64.b64encode(blob).decode(),
                                             "encoding": "base64"})
        assert not w.is_error, w.content
        r = await c.call_tool("run", {"command": "echo $IN; pwd; wc -c < data.bin"})
        assert r.structured_content["output"] == f"container\n/tmp/w\n{len(blob)}\n"
        back = await c.call_tool("read_file", {"path": "/tmp/w/data.bin"})
        assert back.structured_content["encoding"] == "base64"
        assert base64.b64decode(back.structured_content["content"]) == blob
        assert containers[0].exec_run(["cat", "/tmp/w/data.bin"]).output == blob

        sp = await c.call_tool("spawn", {"command": "echo up; echo IN-CONTAINER-READY; sleep 300",
                                         "watch": ["IN-CONTAINER-READY"]})
        assert not sp.is_error, sp.content
        waited = await c.call_tool("process_wait", {"id": sp.structured_content["id"], "timeout": 60})
        assert waited.structured_content["event"] == "match"
        killed = await c.call_tool("process_kill", {"id": sp.structured_content["id"]})
        assert killed.structured_content["status"] == "killed"
    # The session ended: its environment, the container, is gone.
    with anyio.fail_after(60):
        while client.containers.list(all=True, filters={"label": f"{LABEL_TASK}={task_id}"}):
            await anyio.sleep(0.2)


@pytest.mark.ssh
async def test_files_over_ssh(sshd_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s = sshd_server
    args = ("--env", "ssh", "-o", f"host={s.host}", "-o", f"port={s.port}", "-o", f"user={s.user}",
            "-o", f"key_path={s.client_key_path}", "-o", "use_agent=false", "-o", "look_for_keys=false",
            "-o", f"known_hosts={tmp_path / 'known_hosts'}")
    async with stdio_client(tmp_path, *args) as c:
        r = await c.call_tool("run", {"command": "d=$(mktemp -d) && cd $d && pwd"})
        assert not r.is_error, r.content
        remote_dir = r.structured_content["output"].strip()
        w = await c.call_tool("write_file", {"path": "note.txt", "content": "über ssh\n"})
        assert not w.is_error, w.content
        back = await c.call_tool("read_file", {"path": f"{remote_dir}/note.txt"})
        assert back.structured_content["content"] == "über ssh\n"
        r = await c.call_tool("run", {"command": "cat note.txt; rm -r \"$PWD\""})
        assert r.structured_content["output"] == "über ssh\n"
