"""Fixtures for plugin tests: the example distribution installed for real, hand-made ones, subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hermes-env-example"


def clean_environ(extra_path: list[Path] | tuple[Path, ...] = (), **overrides: str) -> dict[str, str]:
    """This process's environment without hermes-env settings, with ``extra_path`` on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_")) and k != "PYTHONPATH"}
    paths = [str(p) for p in extra_path]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(overrides)
    return env


@pytest.fixture(autouse=True)
def _no_hermes_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith(("TERMINAL_", "HERMES_ENV_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the example distribution was pip-installed into (``--target``)."""
    # Built from a copy: pip builds in the source directory and would leave build/ there.
    source = tmp_path_factory.mktemp("example-src") / EXAMPLE.name
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*"))
    target = tmp_path_factory.mktemp("example-site")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-input",
            "--quiet",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"pip install of the example failed:\n{proc.stdout}\n{proc.stderr}"
    assert list(target.glob("hermes_env_example-*.dist-info")), sorted(p.name for p in target.iterdir())
    return target


@pytest.fixture
def make_dist(tmp_path: Path) -> Callable[..., Path]:
    """Write an installed distribution (dist-info plus modules) into a fresh site directory; returns it.

    ``entry_points`` maps entry point names to values of group ``hermes_env``;
    ``modules`` maps module paths (``pkg/mod.py``) to source.
    """
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)

    def make(name: str, entry_points: Mapping[str, str], modules: Mapping[str, str], version: str = "1.0") -> Path:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = ["[hermes_env]"] + [f"{k} = {v}" for k, v in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for rel, source in modules.items():
            path = site / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
        return site

    return make


@pytest.fixture
def subprocess_env() -> Callable[..., dict[str, str]]:
    """``clean_environ``, for tests that start their own subprocesses."""
    return clean_environ


@pytest.fixture
def example_dir() -> Path:
    return EXAMPLE


@pytest.fixture
def run_py() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run Python code in a fresh interpreter with ``path`` on PYTHONPATH."""

    def run(code: str, path: list[Path] | tuple[Path, ...] = (), **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            env=clean_environ(path, **env),
            timeout=120,
        )

    return run
