"""The minimal example and the template reach hermes-env through public names only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [*(REPO / "examples" / "hermes-env-example" / "hermes_env_example").glob("*.py"),
     *(REPO / "examples" / "template").rglob("*.py")]
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_private_name_of_the_core_is_used(path):
    tree = ast.parse(path.read_text())
    private: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hermes_env_core"):
            private += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            private += [node.module for part in node.module.split(".") if part.startswith("_")]
        elif isinstance(node, ast.Import):
            private += [a.name for a in node.names if a.name.startswith("hermes_env_core") and "._" in a.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append(ast.unparse(node))
    assert not private, f"{path.name} uses private names: {private}"
    assert SOURCES, "nothing checked"
