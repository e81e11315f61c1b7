"""mode = "auto": managed when a gateway token is configured, else direct when
Modal credentials exist, else an error saying both ways to fix it."""

from __future__ import annotations

import uuid

import pytest
from hermes_env_modal import ModalConfig, ModalEnvironment
from hermes_env_modal.config import gateway_url, modal_credentials_source, resolve_mode
from hermes_env_modal.direct import DirectModalEnvironment
from hermes_env_modal.managed import ManagedModalEnvironment

from hermes_env_core.errors import ConfigError
from hermes_env_core.factory import create_environment


def _no_toml(tmp_path) -> dict[str, str]:
    return {"MODAL_CONFIG_PATH": str(tmp_path / "absent.toml")}


def test_gateway_token_wins_over_modal_credentials(tmp_path):
    cfg = ModalConfig(gateway_url="https://gw.example", gateway_token="t")
    env = {**_no_toml(tmp_path), "MODAL_TOKEN_ID": "ak", "MODAL_TOKEN_SECRET": "as"}
    assert resolve_mode(cfg, env) == "managed"


def test_direct_from_environment_variables(tmp_path):
    env = {**_no_toml(tmp_path), "MODAL_TOKEN_ID": "ak", "MODAL_TOKEN_SECRET": "as"}
    assert resolve_mode(ModalConfig(), env) == "direct"
    assert modal_credentials_source(ModalConfig(), env) == "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"


def test_half_a_token_is_no_credential(tmp_path):
    with pytest.raises(ConfigError):
        resolve_mode(ModalConfig(), {**_no_toml(tmp_path), "MODAL_TOKEN_ID": "ak"})


def test_direct_from_the_active_profile_of_modal_toml(tmp_path):
    toml = tmp_path / "modal.toml"
    toml.write_text(
        '[default]\ntoken_id = "ak-d"\ntoken_secret = "as-d"\n'
        '[work]\nactive = true\ntoken_id = "ak-w"\ntoken_secret = "as-w"\n'
        "[empty]\n"
    )
    env = {"MODAL_CONFIG_PATH": str(toml)}
    assert resolve_mode(ModalConfig(), env) == "direct"
    assert "'work'" in modal_credentials_source(ModalConfig(), env)  # type: ignore[operator]
    with pytest.raises(ConfigError):
        resolve_mode(ModalConfig(), {**env, "MODAL_PROFILE": "empty"})


def test_direct_from_config_tokens(tmp_path):
    cfg = ModalConfig(token_id="ak", token_secret="as")
    assert resolve_mode(cfg, _no_toml(tmp_path)) == "direct"


def test_nothing_configured_explains_both_fixes(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_mode(ModalConfig(), _no_toml(tmp_path))
    text = str(info.value)
    for needle in ("gateway_url", "gateway_token", "modal token new", "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        assert needle in text


def test_gateway_url_is_found_as_the_seed_system_finds_it(tmp_path):
    # hermes-agent tools/managed_tool_gateway.py: build_vendor_gateway_url("modal")
    assert gateway_url(ModalConfig(), {}) == "https://modal-gateway.nousresearch.com"
    assert gateway_url(ModalConfig(), {"TOOL_GATEWAY_DOMAIN": "gw.test", "TOOL_GATEWAY_SCHEME": "http"}) == (
        "http://modal-gateway.gw.test"
    )
    assert gateway_url(ModalConfig(), {"MODAL_GATEWAY_URL": "https://m.test/", "TOOL_GATEWAY_DOMAIN": "x"}) == (
        "https://m.test"
    )
    assert gateway_url(ModalConfig(gateway_url="https://opt.test"), {"MODAL_GATEWAY_URL": "https://m"}) == (
        "https://opt.test"
    )
    with pytest.raises(ConfigError, match="TOOL_GATEWAY_SCHEME.*'ftp'"):
        gateway_url(ModalConfig(), {"TOOL_GATEWAY_SCHEME": "ftp"})


def test_token_sources_select_managed_mode(tmp_path):
    env = {**_no_toml(tmp_path), "HERMES_HOME": str(tmp_path / "hh")}
    assert resolve_mode(ModalConfig(), {**env, "TOOL_GATEWAY_USER_TOKEN": "tok"}) == "managed"
    # An explicit managed mode with no token anywhere names the three sources.
    with pytest.raises(ConfigError) as info:
        resolve_mode(ModalConfig(mode="managed"), env)
    for needle in ("gateway_token", "TOOL_GATEWAY_USER_TOKEN", str(tmp_path / "hh" / "auth.json")):
        assert needle in str(info.value)
    (tmp_path / "hh").mkdir()
    (tmp_path / "hh" / "auth.json").write_text('{"providers": {"nous": {"access_token": "a"}}}')
    assert resolve_mode(ModalConfig(mode="managed"), env) == "managed"
    # The auth store alone does not turn auto into managed: a Modal token still means direct.
    assert resolve_mode(ModalConfig(), {**env, "MODAL_TOKEN_ID": "ak", "MODAL_TOKEN_SECRET": "as"}) == "direct"


def test_an_explicit_mode_is_not_second_guessed(tmp_path):
    assert resolve_mode(ModalConfig(mode="direct"), _no_toml(tmp_path)) == "direct"


def test_auto_builds_the_managed_class(gateway):
    with ModalEnvironment(gateway_url=gateway.url, gateway_token=gateway.token) as env:
        assert isinstance(env, ManagedModalEnvironment) and env.mode == "managed"


def test_auto_builds_the_direct_class(modal_emu, monkeypatch):
    monkeypatch.delenv("TOOL_GATEWAY_USER_TOKEN", raising=False)
    with ModalEnvironment(task_id=f"auto-{uuid.uuid4().hex[:6]}") as env:  # emulator's MODAL_TOKEN_* set
        assert isinstance(env, DirectModalEnvironment) and env.mode == "direct"
        assert env.execute("echo d").output == "d\n"


def test_the_factory_resolves_modal_through_the_registry(gateway, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no hermes-env.toml around
    monkeypatch.setenv("TERMINAL_GATEWAY_URL", gateway.url)
    monkeypatch.setenv("TERMINAL_GATEWAY_TOKEN", gateway.token)
    with create_environment("modal") as env:
        assert isinstance(env, ManagedModalEnvironment)
        assert env.execute("echo via-factory").output == "via-factory\n"


def test_doctor_check_names_the_missing_credentials(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for var in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "TERMINAL_GATEWAY_TOKEN", "TERMINAL_GATEWAY_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "absent.toml"))
    (problem,) = ModalEnvironment.check_requirements()
    assert "modal token new" in problem and "gateway_token" in problem
    monkeypatch.setenv("TERMINAL_GATEWAY_URL", "https://gw.example")
    monkeypatch.setenv("TERMINAL_GATEWAY_TOKEN", "t")
    assert ModalEnvironment.check_requirements() == []
