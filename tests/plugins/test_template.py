"""The plugin template: rendered by scripts/new-plugin.py, installed with pip, it is listed
by the console script and its generated test module passes the conformance suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def test_rendered_template_installs_lists_and_passes_the_suite(tmp_path, subprocess_env):
    dest = tmp_path / "hermes-env-my-box"
    proc = run([sys.executable, str(REPO / "scripts" / "new-plugin.py"), "my-box", str(dest)], os.environ.copy(), tmp_path)
    assert proc.returncode == 0, proc.stderr
    leftovers = [p for p in dest.rglob("*") if "__" in p.name.strip("_") and "__init__" not in p.name]
    assert not leftovers
    assert "__NAME__" not in "".join(p.read_text() for p in dest.rglob("*") if p.is_file())
    site = tmp_path / "site"
    proc = run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--quiet", "--target", str(site),
                str(dest)], os.environ.copy(), tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = subprocess_env([site])
    listing = run([HERMES_ENV, "backends", "--json"], env, tmp_path, timeout=120)
    rows = {r["name"]: r for r in json.loads(listing.stdout)["backends"]}
    assert rows["my-box"]["distribution"] == "hermes-env-my-box" and rows["my-box"]["loadable"], listing.stdout
    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(dest / "tests")], env, dest)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout


def test_new_plugin_refuses_a_bad_name(tmp_path):
    proc = run([sys.executable, str(REPO / "scripts" / "new-plugin.py"), "My Box", str(tmp_path / "x")],
               os.environ.copy(), tmp_path, timeout=60)
    assert proc.returncode != 0 and "'My Box' must match" in proc.stderr
    assert not (tmp_path / "x").exists()
