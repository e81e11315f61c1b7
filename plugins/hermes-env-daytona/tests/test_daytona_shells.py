"""Every image runs the whole command: the daemon's shell (zsh, bash or sh) reads it from stdin.

The daemon does not run ``<shell> -c command``: it starts the shell its
``GetShell()`` picks from the image's /etc/shells and writes the command to
its stdin (see ``emulator/images.py``). A script sent as it is to a bash
sandbox is cut off by its own first line when that line moves stdin
(``exec ... </dev/null``): the regression these tests pin down.
"""

from __future__ import annotations

import shutil

import pytest

from hermes_env_core.errors import EnvironmentUnavailable

IMAGES = {
    "bash image (python:3.12-slim)": "python:3.12-slim",
    "default snapshot (zsh)": None,
}


@pytest.fixture(params=list(IMAGES), ids=list(IMAGES))
def image(request):
    return IMAGES[request.param]


def test_emulated_daemon_feeds_the_command_on_stdin(emu, make_env, image):
    # The emulator itself: the shell gets the command on stdin, not as `-c`, so
    # `$0` is the shell's own name and a multi-line command runs line by line.
    env = make_env(image=image)
    sb = env.sandbox
    res = sb.process.exec("echo \"[$0]\"\necho second line")
    assert res.exit_code == 0
    first, second = res.result.splitlines()
    # zsh in the default snapshot (dash stands in where zsh is not installed)
    expected = "bash" if image else ("zsh" if shutil.which("zsh") else "dash")
    assert first.strip("[]").endswith(expected), res.result
    assert second == "second line"
    # Moving stdin stops the shell reading its command: the bug's mechanism, as on the daemon.
    res = sb.process.exec("exec </dev/null; echo first\necho never")
    assert res.result == ("first\n" if image else res.result)  # dash reads its input in blocks; bash byte by byte


def test_whole_script_runs_and_exit_status_is_the_commands(make_env, image):
    env = make_env(image=image)
    r = env.execute("echo hello; exit 3")
    assert (r.output, r.exit_code) == ("hello\n", 3)
    r = env.execute("echo one\necho two\nfalse")
    assert (r.output, r.exit_code) == ("one\ntwo\n", 1)
    env.execute("cd /tmp && export KEPT=yes")
    r = env.execute("echo $PWD $KEPT")
    assert r.output == "/tmp yes\n"


def test_stdin_of_the_command_is_its_own(make_env, image):
    env = make_env(image=image)
    r = env.execute("cat; echo done", stdin="from the caller\n")
    assert r.output == "from the caller\ndone\n"
    assert env.execute("cat").output == ""  # no stdin given: empty, never the rest of the script


def test_image_without_bash_fails_with_a_clear_error(make_env):
    env = make_env(image="alpine:3.20")
    with pytest.raises(EnvironmentUnavailable, match="has no bash.*needs bash"):
        env.execute("true")
