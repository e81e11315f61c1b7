"""The local backend's environment: invalid names rejected, secrets kept out."""

from __future__ import annotations

import string
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hermes_env_core.backends.local import LocalConfig, LocalEnvironment, carries_url_password, filter_environment

_FIRST = string.ascii_letters + "_"
_REST = _FIRST + string.digits
valid_names = st.builds(lambda a, b: a + b, st.sampled_from(_FIRST), st.text(_REST, max_size=12))


@pytest.mark.parametrize("name", ["A B", "1X", "", "A=B", "A-B", "Ä", "X\n"])
def test_invalid_env_name_rejected_at_construction(name):
    with pytest.raises(ValidationError) as info:
        LocalEnvironment(env={name: "v"})
    assert repr(name) in str(info.value)


@given(st.text(max_size=8))
@settings(max_examples=200)
def test_env_names_accepted_exactly_when_bash_accepts_them(name):
    ok = bool(name) and name[0] in _FIRST and all(c in _REST for c in name)
    if ok:
        assert LocalConfig(env={name: "v"}).env == {name: "v"}
    else:
        with pytest.raises(ValidationError, match="not a valid variable name"):
            LocalConfig(env={name: "v"})


def test_valid_env_name_reaches_the_command():
    with LocalEnvironment(env={"_HERMES_OK1": "x y"}) as env:
        assert env.execute('printf "%s" "$_HERMES_OK1"').output == "x y"


@pytest.mark.parametrize(
    "name", ["PGPASSWORD", "MYSQL_PWD", "SECRET_KEY", "PRIVATE_KEY", "AZURE_SQL_CONNECTION_STRING", "pgpassword"]
)
def test_more_secret_names_filtered(name):
    assert filter_environment({name: "hunter2", "PATH": "/bin"}) == {"PATH": "/bin"}


def test_url_with_password_filtered_and_reaches_no_command(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://u:p@h/db")
    monkeypatch.setenv("PLAIN_URL", "https://example.com/path?q=1")
    monkeypatch.setenv("USER_ONLY_URL", "ssh://git@example.com/repo")
    with LocalEnvironment() as env:
        r = env.execute('echo "${DATABASE_URL-unset} $PLAIN_URL $USER_ONLY_URL"')
    assert r.output == "unset https://example.com/path?q=1 ssh://git@example.com/repo\n"


def test_passthrough_beats_the_value_filter():
    out = filter_environment({"DATABASE_URL": "postgres://u:p@h/db"}, passthrough=("DATABASE_URL",))
    assert out == {"DATABASE_URL": "postgres://u:p@h/db"}


schemes = st.sampled_from(["postgres", "postgresql+psycopg", "mysql", "redis", "amqp", "https", "mongodb+srv"])
userinfo_text = st.text(string.ascii_letters + string.digits + "-._~!$&'()*+,;=%@:/ ", min_size=1, max_size=10)
hosts = st.sampled_from(["h", "db.example.com", "10.0.0.1:5432", "[::1]:6379", "localhost"])


@given(schemes, st.text(string.ascii_letters + string.digits, max_size=6), userinfo_text, hosts,
       st.sampled_from(["", "/db", "/db?sslmode=require"]), st.sampled_from(["", "X=", "--url ", "a,"]))
@settings(max_examples=300)
def test_any_url_with_a_password_is_detected(scheme, user, password, host, path, prefix):
    value = f"{prefix}{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{host}{path}"
    assert carries_url_password(value)
    assert filter_environment({"SOME_URL": value}) == {}


@given(schemes, st.text(string.ascii_letters + string.digits, max_size=6), hosts,
       st.sampled_from(["", "/db", "/p@th", "/x?a=b:c@d"]))
@settings(max_examples=300)
def test_urls_without_password_are_kept(scheme, user, host, path):
    value = f"{scheme}://{user + '@' if user else ''}{host}{path}"
    assert not carries_url_password(value)
    assert filter_environment({"SOME_URL": value}) == {"SOME_URL": value}


@given(st.text(max_size=40))
@settings(max_examples=300)
def test_url_check_never_raises(value):
    assert carries_url_password(value) in (True, False)
