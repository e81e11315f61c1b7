"""Finding the runtime: apptainer, then singularity, or the configured path; a clear error otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from hermes_env_singularity.backend import SingularityEnvironment
from hermes_env_singularity.config import SingularityConfig
from hermes_env_singularity.runtime import RuntimeNotFoundError, find_runtime
from pydantic import ValidationError


def _exe(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_apptainer_preferred_then_singularity(tmp_path: Path) -> None:
    a, s = tmp_path / "a", tmp_path / "s"
    a.mkdir()
    s.mkdir()
    _exe(s / "singularity")
    assert find_runtime(path=f"{a}:{s}").path == str(s / "singularity")
    assert find_runtime(path=f"{a}:{s}").flavor == "singularity"
    _exe(a / "apptainer")
    assert find_runtime(path=f"{s}:{a}").path == str(a / "apptainer")


def test_configured_path_or_name(tmp_path: Path) -> None:
    exe = _exe(tmp_path / "my-apptainer")
    assert find_runtime(str(exe), path="").path == str(exe)
    assert find_runtime("my-apptainer", path=str(tmp_path)).path == str(exe)


def test_missing_runtime_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(RuntimeNotFoundError) as info:
        find_runtime(path=str(tmp_path))
    msg = str(info.value)
    assert "neither 'apptainer' nor 'singularity'" in msg and "install Apptainer" in msg and "executable" in msg


def test_missing_configured_runtime(tmp_path: Path) -> None:
    with pytest.raises(RuntimeNotFoundError, match="configured executable .*not an executable file"):
        find_runtime(str(tmp_path / "nope"))


def test_environment_without_runtime_raises_before_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeNotFoundError, match="install Apptainer"):
        SingularityEnvironment(image=str(tmp_path / "x.sif"))


def test_check_requirements_reports_the_missing_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    problems = SingularityEnvironment.check_requirements()
    assert len(problems) == 1 and "install Apptainer" in problems[0]


def test_check_requirements_ok_with_the_real_runtime(runtime) -> None:
    assert SingularityEnvironment.check_requirements() == []


@pytest.mark.parametrize(
    "options, field",
    [
        ({}, "image"),
        ({"image": "x", "memory": "lots"}, "memory"),
        ({"image": "x", "cpu": 0}, "cpu"),
        ({"image": "x", "overlay": "persistent"}, "task_id"),
        ({"image": "x", "overlay": "disk"}, "overlay"),
        ({"image": "x", "imgae": "y"}, "imgae"),
        ({"image": "x", "extra_args": ["--memory=1G"]}, "config field"),
    ],
)
def test_config_validated(options: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        SingularityConfig(**options)


def test_memory_forms() -> None:
    assert SingularityConfig(image="x", memory="512M").memory == "512m"
    assert SingularityConfig(image="x", memory=" 2g ").memory == "2g"
    with pytest.raises(ValidationError, match="with a unit"):
        SingularityConfig(image="x", memory=1 << 20)
