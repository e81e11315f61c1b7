"""scripts/logic-lines.py: what counts as a backend's own logic, and the table CI prints."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "logic-lines.py"

SAMPLE = textwrap.dedent(
    '''\
    """Module docstring,
    over two lines."""

    from __future__ import annotations

    import os  # an import with a comment
    from typing import (
        Any,
    )

    # a comment line

    X = 1  # code with a comment            (1)


    class A:                                # (2)
        """Class docstring."""

        def f(self) -> str:                 # (3)
            """Function
            docstring."""
            text = """not a docstring:       (4)
            it is a value"""                # (5)
            return text                     # (6)
    '''
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_counts_only_logic(tmp_path):
    f = tmp_path / "sample.py"
    f.write_text(SAMPLE)
    proc = run("--json", str(f))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {str(f): 6}


def test_table_lists_every_backend_with_a_count():
    proc = run("--json")
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout)
    assert {"local", "docker", "ssh", "example"} <= set(counts)
    assert all(isinstance(n, int) and n > 0 for n in counts.values())
    # The minimal third-party example stays within its budget of about 60 lines.
    assert counts["example"] <= 60
    text = run()
    assert text.returncode == 0 and text.stdout.splitlines()[0].split()[:2] == ["backend", "own"]
