"""The pull-back at close over a real OpenSSH server: it never races the
connection's shutdown, and when it fails (here: the target's tar fails), the
target's edits are neither lost nor overwritten by the next push."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hermes_env_core.errors import SyncConflictError, SyncError
from hermes_env_core.sync import JOURNAL_ENV
from tests.backends.test_ssh import _make
from tests.support.sshd import SshdUnavailable, SshServer

pytestmark = pytest.mark.ssh

# A target whose tar cannot send archives while ~/fail-download exists.
_TAR_SHIM = textwrap.dedent(
    """\
    #!/bin/sh
    if [ -e "$HOME/fail-download" ]; then
      case " $* " in *" -c"*) echo "tar: simulated read error" >&2; exit 2 ;; esac
    fi
    exec /bin/tar "$@"
    """
)


@pytest.fixture(autouse=True)
def journal_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "journal"
    monkeypatch.setenv(JOURNAL_ENV, str(path))
    return path


@pytest.fixture
def failing_server():
    server = SshServer(user="hermes-pullfail")
    try:
        server.start()
    except SshdUnavailable as exc:
        pytest.fail(f"OpenSSH server required: {exc}")
    home = Path(pwd.getpwnam(server.user).pw_dir)
    (home / "bin").mkdir(exist_ok=True)
    (home / "bin" / "tar").write_text(_TAR_SHIM)
    (home / "bin" / "tar").chmod(0o755)
    (home / ".bashrc").write_text('export PATH="$HOME/bin:$PATH"\n')
    for p in (home / "bin", home / "bin" / "tar", home / ".bashrc"):
        os.chown(p, server.uid, server.gid)
    try:
        yield server
    finally:
        server.close()
        for p in (home / "bin" / "tar", home / ".bashrc", home / "fail-download"):
            p.unlink(missing_ok=True)


def test_fifty_sessions_closed_in_a_row_lose_no_edit(sshd_server, tmp_path: Path, journal_dir: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "f.txt").write_text("v0\n")
    remote = f"hermes_close50_{os.getpid()}_{tmp_path.name}"
    lost = []
    for i in range(1, 51):
        env = _make(sshd_server, tmp_path, sync=[{"host": str(work), "remote": remote}], sync_interval_s=0)
        try:
            # The command goes through the resident channel, whose shutdown used to kill the connection.
            assert env.execute(f"echo v{i} > ~/{remote}/f.txt; echo {i} > ~/{remote}/n{i}.txt").exit_code == 0
        finally:
            env.close()
        if (work / "f.txt").read_text() != f"v{i}\n" or not (work / f"n{i}.txt").exists():
            lost.append(i)
    assert lost == []
    assert not journal_dir.exists() or not list(journal_dir.iterdir())


def test_a_failed_pull_at_close_raises_and_the_next_push_refuses(failing_server, tmp_path: Path, journal_dir: Path) -> None:
    home = Path(pwd.getpwnam(failing_server.user).pw_dir)
    work = tmp_path / "work"
    work.mkdir()
    (work / "f.txt").write_text("host\n")
    remote = f"proj_{tmp_path.name}"
    sync = [{"host": str(work), "remote": remote}]
    env = _make(failing_server, tmp_path, sync=sync, sync_interval_s=0)
    assert env.execute(f"echo edited > ~/{remote}/f.txt; touch ~/fail-download").exit_code == 0
    with pytest.raises(SyncError, match="pull-back failed.*simulated read error") as failed:
        env.close()
    assert "pushes are refused" in str(failed.value)
    assert env.closed
    assert (work / "f.txt").read_text() == "host\n"
    assert len(list(journal_dir.iterdir())) == 1
    (home / "fail-download").unlink()

    env = _make(failing_server, tmp_path, sync=sync, sync_interval_s=0, pull_on_close=False)
    try:
        with pytest.raises(SyncConflictError, match="never pulled back") as refused:
            env.execute("true")
        assert str(work) in str(refused.value)
        assert (home / remote / "f.txt").read_text() == "edited\n"  # not overwritten
        result = env.pull_files()
        assert result is not None and result.updated == (str(work / "f.txt"),)
        assert (work / "f.txt").read_text() == "edited\n"
        assert env.execute(f"cat ~/{remote}/f.txt").output == "edited\n"
    finally:
        env.close()
    assert not list(journal_dir.iterdir())


def _cli(config: Path, journal_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, JOURNAL_ENV: str(journal_dir), "HERMES_ENV_CONFIG": str(config)}
    return subprocess.run(
        [sys.executable, "-m", "hermes_env_core.cli", *argv],
        capture_output=True, text=True, env=environ, timeout=120, stdin=subprocess.DEVNULL,
    )


def test_cli_says_so_in_one_line_and_exits_non_zero(failing_server, tmp_path: Path, journal_dir: Path) -> None:
    home = Path(pwd.getpwnam(failing_server.user).pw_dir)
    work = tmp_path / "work"
    work.mkdir()
    (work / "f.txt").write_text("host\n")
    remote = f"proj_{tmp_path.name}"
    config = tmp_path / "hermes-env.toml"
    config.write_text(textwrap.dedent(f"""\
        [terminal]
        env = "ssh"
        [terminal.ssh]
        host = "{failing_server.host}"
        port = {failing_server.port}
        user = "{failing_server.user}"
        key_path = "{failing_server.client_key_path}"
        use_agent = false
        look_for_keys = false
        known_hosts = "{tmp_path / 'known_hosts'}"
        sync = [{{ host = "{work}", remote = "{remote}" }}]
        """))
    r = _cli(config, journal_dir, "run", f"echo edited > ~/{remote}/f.txt; touch ~/fail-download; echo done")
    assert r.stdout == "done\n"
    assert r.returncode == 125, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hermes-env: error: pull-back failed"), r.stderr
    assert (work / "f.txt").read_text() == "host\n"

    # The next call refuses to push (one line, non-zero); its own pull-back at close then succeeds.
    (home / "fail-download").unlink()
    r = _cli(config, journal_dir, "run", "echo never ran")
    assert r.returncode == 125 and "never ran" not in r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "push refused" in lines[0] and str(work) in lines[0], r.stderr
    assert (work / "f.txt").read_text() == "edited\n"

    r = _cli(config, journal_dir, "pull")
    assert (r.returncode, r.stdout, r.stderr) == (0, "nothing to pull\n", "")
    r = _cli(config, journal_dir, "run", f"cat ~/{remote}/f.txt")
    assert (r.returncode, r.stdout) == (0, "edited\n"), r.stderr
