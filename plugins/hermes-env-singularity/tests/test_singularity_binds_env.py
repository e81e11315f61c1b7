"""Bind mounts (read-only when asked) and what reaches the container's environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from hermes_env_singularity.backend import SingularityEnvironment, _container_env
from hermes_env_singularity.config import BindMount, SingularityConfig
from pydantic import ValidationError

from hermes_env_core.errors import ConfigError


def test_binds_read_write_and_read_only(sif: Path, tmp_path: Path) -> None:
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    (ro / "given").write_text("from-host\n")
    with SingularityEnvironment(image=str(sif), binds=[f"{rw}:/work", f"{ro}:/data/in:ro"]) as env:
        r = env.execute("echo made > /work/out && cat /data/in/given")
        assert r.exit_code == 0 and r.output == "from-host\n"
        r = env.execute("echo x > /data/in/new")
        assert r.exit_code != 0 and "Read-only file system" in r.output
    assert (rw / "out").read_text() == "made\n"
    assert not (ro / "new").exists()


def test_bind_to_the_same_path(sif: Path, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("same\n")
    with SingularityEnvironment(image=str(sif), binds=[{"source": str(tmp_path), "read_only": True}]) as env:
        assert env.execute(f"cat {tmp_path}/f").output == "same\n"


def test_missing_bind_source_is_named(sif: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="bind source .*nope does not exist"):
        SingularityEnvironment(image=str(sif), binds=[f"{tmp_path / 'nope'}:/x"])


@pytest.mark.parametrize(
    "spec, bad",
    [("/a:rel/path", "absolute"), ("/a:/b:/c:ro", "SRC"), ("/a,b:/c", "','"), ("/a:/b:rx", "SRC")],
)
def test_bind_specs_validated(spec: str, bad: str) -> None:
    with pytest.raises(ValidationError, match=bad):
        SingularityConfig(image="x.sif", binds=[spec])


def test_bind_spec_forms() -> None:
    assert BindMount.model_validate("/a").spec("/a") == "/a:/a"
    assert BindMount.model_validate("/a:/b:ro").spec("/a") == "/a:/b:ro"
    assert BindMount.model_validate("/a:ro").read_only


def test_env_passthrough_filters_secrets(sif: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERMES_T_PLAIN", "plain")
    monkeypatch.setenv("HERMES_T_API_KEY", "sk-secret")
    monkeypatch.setenv("HERMES_T_ALLOWED_TOKEN", "tok")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
    probe = 'echo "${HERMES_T_PLAIN-unset} ${HERMES_T_API_KEY-unset} ${HERMES_T_ALLOWED_TOKEN-unset} ${OPENAI_API_KEY-unset}"'
    # By default nothing of the host's environment goes in.
    with SingularityEnvironment(image=str(sif)) as env:
        assert env.execute(probe).output == "unset unset unset unset\n"
    # inherit_env: everything but secret-looking names, unless passed through by name.
    with SingularityEnvironment(image=str(sif), inherit_env=True, env_passthrough=("HERMES_T_ALLOWED_*",)) as env:
        assert env.execute(probe).output == "plain unset tok unset\n"
        # The container keeps its own PATH and HOME.
        assert env.execute('echo "$PATH|$HOME"').output == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin|/root\n"
    # Without inherit_env, only the names asked for (secret-looking or not).
    with SingularityEnvironment(image=str(sif), env_passthrough=("HERMES_T_PLAIN", "HERMES_T_API_KEY")) as env:
        assert env.execute(probe).output == "plain sk-secret unset unset\n"


def test_env_blocklist_with_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERMES_T_INTERNAL_URL", "http://x")
    cfg = SingularityConfig(image="x.sif", inherit_env=True, env_blocklist=("HERMES_T_INTERNAL_*",))
    assert "APPTAINERENV_HERMES_T_INTERNAL_URL" not in _container_env(cfg)


def test_explicit_env_values_with_newlines_and_path(sif: Path) -> None:
    env_vars = {"HERMES_T_MULTI": "a\nb, c=d", "PATH": "/opt/x:/usr/bin:/bin"}
    with SingularityEnvironment(image=str(sif), env=env_vars) as env:
        r = env.execute('printf "%s|" "$HERMES_T_MULTI" "$PATH"')
    assert r.output == "a\nb, c=d|/opt/x:/usr/bin:/bin|"


def test_env_home_refused() -> None:
    with pytest.raises(ConfigError, match="HOME"):
        _container_env(SingularityConfig(image="x.sif", env={"HOME": "/x"}))


def test_host_apptainer_settings_never_enter_the_container(sif: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPTAINERENV_HERMES_T_SNEAKY", "leaked")
    with SingularityEnvironment(image=str(sif), inherit_env=True) as env:
        assert env.execute('echo "${HERMES_T_SNEAKY-unset}"').output == "unset\n"
