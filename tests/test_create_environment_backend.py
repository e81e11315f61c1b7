"""Choosing a backend in Python: ``backend=`` (or the first argument); ``env=`` is the variables, never the backend."""

from __future__ import annotations

import os

import pytest

from hermes_env_core import ConfigError, EnvironmentFactory, EnvironmentPool, create_environment
from hermes_env_core.backends.local import LocalEnvironment


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(("TERMINAL_", "HERMES_ENV_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def test_backend_keyword_chooses_the_backend(monkeypatch):
    monkeypatch.setenv("TERMINAL_ENV", "no-such-backend")  # the keyword wins over the environment
    with create_environment(backend="local", env={"GREETING": "hi"}) as env:
        assert isinstance(env, LocalEnvironment)
        assert env.execute('echo "$GREETING"').output == "hi\n"


def test_backend_keyword_reaches_the_backend_and_its_options():
    with pytest.raises(ConfigError, match="backend 'docker'") as err:
        create_environment(backend="docker", image="", colour="blue")
    assert "unknown option 'colour' for backend 'docker'" in str(err.value)


def test_the_positional_form_still_works():
    with create_environment("local") as env:
        assert isinstance(env, LocalEnvironment)


def test_two_different_backends_at_once_are_refused():
    with pytest.raises(TypeError, match="given twice: 'local' and backend='docker'"):
        create_environment("local", backend="docker")


@pytest.mark.parametrize("make", [
    lambda: create_environment(env="docker", image="python:3.12"),
    lambda: EnvironmentFactory().create(env="docker"),
    lambda: EnvironmentPool(idle_timeout=None).get("t1", env="docker"),
])
def test_env_given_a_string_says_what_env_is_and_what_was_meant(make):
    with pytest.raises(ConfigError) as err:
        make()
    message = str(err.value)
    assert "env is the dict of environment variables" in message
    assert "backend='docker'" in message
    assert "unknown option 'image'" not in message


def test_the_pool_and_the_factory_take_backend_as_a_keyword_too():
    with EnvironmentPool(idle_timeout=None, backend="local") as pool:
        assert isinstance(pool.get("t1"), LocalEnvironment)
    with EnvironmentFactory().create(backend="local") as env:
        assert isinstance(env, LocalEnvironment)
