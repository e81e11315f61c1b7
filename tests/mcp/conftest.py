from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mcp.mcpsupport import Events, HttpServer, http_client, http_server, stdio_client


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def http_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    with http_server(tmp_path_factory.mktemp("mcp-http")) as srv:
        yield srv


Connect = Callable[..., contextlib.AbstractAsyncContextManager[Any]]


@pytest.fixture(params=["stdio", "http"])
def connect(request: pytest.FixtureRequest, tmp_path: Path) -> Connect:
    """``async with connect(events=None) as client``: a new MCP session over the transport under test."""
    if request.param == "stdio":

        @contextlib.asynccontextmanager
        async def open_stdio(events: Events | None = None) -> AsyncIterator[Any]:
            async with stdio_client(tmp_path, events=events) as client:
                yield client

        return open_stdio
    srv = request.getfixturevalue("http_srv")

    @contextlib.asynccontextmanager
    async def open_http(events: Events | None = None) -> AsyncIterator[Any]:
        async with http_client(srv, events=events) as client:
            yield client

    return open_http
