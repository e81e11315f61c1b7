"""A client process the tests kill mid-command: ``client_script.py stdio|http PIDFILE`` (HTTP: $MCP_URL, $MCP_TOKEN)."""

from __future__ import annotations

import os
import sys

import anyio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mcpsupport import HttpServer, http_client, stdio_client  # noqa: E402
from pathlib import Path  # noqa: E402


async def main(mode: str, pidfile: str) -> None:
    command = f"sh -c 'echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 300'"
    if mode == "stdio":
        async with stdio_client(Path(os.environ["MCP_TMP"])) as client:
            await client.call_tool("run", {"command": command, "timeout": 600})
    else:
        server = HttpServer(None, os.environ["MCP_URL"], os.environ["MCP_TOKEN"], [])  # type: ignore[arg-type]
        async with http_client(server) as client:
            await client.call_tool("run", {"command": command, "timeout": 600})


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
