"""The parts of hermes-env mcp below the protocol: file tools' quoting (Hypothesis), argument parsing."""

from __future__ import annotations

import argparse
import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.mcp import _host_port
from hermes_env_core.mcp.serve import _request_ids
from hermes_env_core.mcp.session import McpShell, ToolError
from hermes_env_core.mcp.tools import TOOLS, check_arguments


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[McpShell, Path]]:
    base = tmp_path_factory.mktemp("files")
    sh = McpShell(lambda: LocalEnvironment())
    sh.run(f"cd {base}")
    yield sh, base
    sh.close()


# Any file name a Linux directory can hold: no NUL, no slash, not . or ..
names = st.text(st.characters(blacklist_characters="\0/", blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda n: n not in (".", "..") and len(n.encode()) <= 255
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=names, content=st.binary(max_size=2000))
def test_any_name_and_bytes_round_trip(shell: tuple[McpShell, Path], name: str, content: bytes) -> None:
    sh, base = shell
    w = sh.write_file(name, base64.b64encode(content).decode(), encoding="base64")
    assert w["bytes_written"] == len(content)
    assert (base / name).read_bytes() == content
    r = sh.read_file(name)
    got = base64.b64decode(r["content"]) if r["encoding"] == "base64" else r["content"].encode()
    assert got == content and r["size"] == len(content)
    (base / name).unlink()


def test_read_cap_never_splits_a_character(shell: tuple[McpShell, Path]) -> None:
    sh, base = shell
    (base / "u.txt").write_text("é" * 10)
    r = sh.read_file("u.txt", max_bytes=5)
    assert r["encoding"] == "utf-8" and r["content"] == "éé" and r["bytes"] == 4 and r["truncated"] is True


def test_write_keeps_the_session_cwd_and_reports_failures(shell: tuple[McpShell, Path]) -> None:
    sh, base = shell
    with pytest.raises(ToolError, match="nope/x"):
        sh.write_file("nope/x", "x")
    with pytest.raises(ToolError, match="not valid base64"):
        sh.write_file("y", "!!", encoding="base64")
    assert sh.run("pwd")["output"] == f"{base}\n"


@pytest.mark.parametrize(("text", "expected"), [
    ("8765", ("127.0.0.1", 8765)),
    ("0.0.0.0:80", ("0.0.0.0", 80)),
    ("[::1]:9000", ("::1", 9000)),
    (":0", ("127.0.0.1", 0)),
])
def test_host_port(text: str, expected: tuple[str, int]) -> None:
    assert _host_port(text) == expected


@pytest.mark.parametrize("text", ["http", "1:2:x", "70000", "localhost:"])
def test_host_port_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="PORT|range"):
        _host_port(text)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c)))
def test_request_ids_never_raise(value: object) -> None:
    import json

    ids = _request_ids(json.dumps(value).encode())
    assert isinstance(ids, list)


def test_request_ids() -> None:
    assert _request_ids(b'{"jsonrpc":"2.0","id":7,"method":"tools/call"}') == [7]
    assert _request_ids(b'[{"id":"a","method":"x"},{"method":"n"},{"id":3,"result":{}}]') == ["a"]
    assert _request_ids(b"not json") == []


def test_every_tool_schema_is_valid_and_checked() -> None:
    import jsonschema

    for spec in TOOLS.values():
        jsonschema.Draft202012Validator.check_schema(spec.input)
        jsonschema.Draft202012Validator.check_schema(spec.output)
    assert check_arguments(TOOLS["run"], {"command": "ls"}) is None
    assert "argument 'max_bytes'" in (check_arguments(TOOLS["read_file"], {"path": "x", "max_bytes": 0}) or "")
