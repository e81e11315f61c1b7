#!/usr/bin/env python3
"""Count each backend's own lines of logic: non-blank lines that are not comments,
docstrings or imports, in the backend's own modules (tests and emulators left out).

    python scripts/logic-lines.py [--json] [FILE ...]

With files, counts those instead. CI prints the table (scripts/test.sh).
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_NOT_CODE = {
    tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
    tokenize.ENCODING, tokenize.ENDMARKER,
}


def logic_lines(source: str) -> int:
    """Lines holding code, less docstrings and import statements."""
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            code.update(range(tok.start[0], tok.end[0] + 1))
    skip: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                skip.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return len(code - skip)


def _own_files(package_dir: Path) -> list[Path]:
    return sorted(p for p in package_dir.rglob("*.py") if not {"tests", "emulator", "bench"} & set(p.parts))


def backends() -> dict[str, list[Path]]:
    """Backend -> its own modules: built-ins by file name, plugins and examples by package."""
    core = ROOT / "hermes_env_core" / "backends"
    found: dict[str, list[Path]] = {}
    for name in ("local", "docker", "ssh"):
        files = [core / f"{name}.py", *core.glob(f"_{name}_*.py")]
        if (core / name).is_dir():
            files += _own_files(core / name)
        found[name] = sorted(p for p in files if p.is_file())
    for parent in ("plugins", "examples"):
        for dist in sorted((ROOT / parent).glob("hermes-env-*")):
            package = dist / dist.name.replace("-", "_")
            if package.is_dir():
                found[dist.name.removeprefix("hermes-env-")] = _own_files(package)
    return found


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    paths = [a for a in argv if a != "--json"]
    groups = {p: [Path(p)] for p in paths} if paths else backends()
    counts = {name: sum(logic_lines(f.read_text(encoding="utf-8")) for f in files) for name, files in groups.items()}
    if as_json:
        print(json.dumps(counts, indent=2))
        return 0
    width = max(map(len, counts), default=7)
    print(f"{'backend':<{width}}  own logic lines  files")
    for name, n in counts.items():
        print(f"{name:<{width}}  {n:>15}  {len(groups[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
