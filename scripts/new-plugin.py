#!/usr/bin/env python3
"""Start a new hermes-env backend plugin from examples/template.

    python scripts/new-plugin.py NAME [DEST]

NAME is the backend name users type (``[a-z][a-z0-9_-]*``); DEST defaults to
./hermes-env-NAME. The result is a distribution that installs and passes the
conformance suite as generated (it runs bash on this machine); its TODOs say
what to replace.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "template"
SKIP = {"TEMPLATE.md"}


def render(name: str, dest: Path) -> Path:
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", name):
        raise SystemExit(f"new-plugin: backend name {name!r} must match [a-z][a-z0-9_-]* (such as 'mybox')")
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"new-plugin: {dest} exists and is not empty; pick another DEST")
    words = re.split(r"[-_]", name)
    values = {
        "__DIST__": f"hermes-env-{name.replace('_', '-')}",
        "__PKG__": "hermes_env_" + "_".join(words),
        "__CLASS__": "".join(w.capitalize() for w in words),
        "__NAME__": name,
    }

    def fill(text: str) -> str:
        for key, value in values.items():
            text = text.replace(key, value)
        return text

    for src in sorted(TEMPLATE.rglob("*")):
        rel = src.relative_to(TEMPLATE)
        if src.is_dir() or rel.name in SKIP or "__pycache__" in rel.parts:
            continue
        out = dest / fill(str(rel)).removesuffix(".tmpl")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(fill(src.read_text(encoding="utf-8")), encoding="utf-8")
    return dest


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or len(argv) > 2:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name = argv[0]
    dest = Path(argv[1]) if len(argv) > 1 else Path(f"hermes-env-{name}")
    print(render(name, dest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
