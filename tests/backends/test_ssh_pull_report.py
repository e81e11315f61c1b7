"""Pull-back over SSH loses only what it must: unsafe entries are skipped and
reported by name while the rest is applied; a tampered archive is refused whole.
Both reach the caller as ``last_pull`` and as a note on the next result."""

from __future__ import annotations

import os
import pwd
import textwrap
from pathlib import Path

import pytest

from hermes_env_core.errors import UnsafeArchiveError
from hermes_env_core.sync import PullResult
from tests.backends.test_ssh import _make
from tests.support.sshd import SshdUnavailable, SshServer

pytestmark = pytest.mark.ssh


def test_unsafe_entries_are_skipped_by_name_and_the_rest_applied(sshd_server, tmp_path):
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "src" / "app.py").write_text("v1\n")
    remote = f"hermes_pullrep_{os.getpid()}_{tmp_path.name}"
    env = _make(sshd_server, tmp_path, sync=[{"host": str(work), "remote": remote}], sync_interval_s=0)
    try:
        r = env.execute(
            f"cd ~/{remote} && mkdir -p venv/bin && ln -s /usr/bin/python3 venv/bin/python"
            " && mkfifo pipe && echo v2 > src/app.py && echo new > src/made.txt && echo ok"
        )
        assert r.output == "ok\n"
        result = env.pull_files()
        assert isinstance(result, PullResult)
        skipped = dict(result.skipped)
        assert set(skipped) == {str(work / "venv" / "bin" / "python"), str(work / "pipe")}
        assert "absolute" in skipped[str(work / "venv" / "bin" / "python")]
        assert "fifo" in skipped[str(work / "pipe")]
        assert (work / "src" / "app.py").read_text() == "v2\n"
        assert (work / "src" / "made.txt").read_text() == "new\n"
        assert not os.path.lexists(work / "venv" / "bin" / "python")
        assert not os.path.lexists(work / "pipe")
        # The next result carries the same news as a note.
        notes = env.execute("true").notes
        assert any("skipped" in n and str(work / "venv" / "bin" / "python") in n for n in notes)
        assert any("skipped" in n and str(work / "pipe") in n for n in notes)
    finally:
        env.close()
    assert env.last_pull is not None and len(env.last_pull.skipped) == 2  # the pull at close said it again


_TAR_SHIM = textwrap.dedent(
    """\
    #!/bin/sh
    # A hostile target: the archive it sends back names a path outside the mapping.
    case " $* " in
      *" -c "*|*" -cf "*|*" -c"*) exec python3 -c '
    import io, sys, tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in (("a.txt", b"changed"), ("../escape.txt", b"x")):
            ti = tarfile.TarInfo(name); ti.size = len(data); tf.addfile(ti, io.BytesIO(data))
    sys.stdout.buffer.write(buf.getvalue())
    ' ;;
    esac
    exec /bin/tar "$@"
    """
)


@pytest.fixture
def hostile_server():
    server = SshServer(user="hermes-kill-tamper")
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
        for p in (home / "bin" / "tar", home / ".bashrc"):
            p.unlink(missing_ok=True)


def test_tampered_archive_is_refused_whole_with_a_report_and_a_note(hostile_server, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_text("original")
    env = _make(hostile_server, tmp_path, sync=[{"host": str(work), "remote": "proj"}], sync_interval_s=0)
    try:
        env.execute("true")  # pushes
        with pytest.raises(UnsafeArchiveError, match=r"'\.\./escape\.txt'"):
            env.pull_files()
        assert (work / "a.txt").read_text() == "original"  # nothing applied
        assert not (tmp_path / "escape.txt").exists()
        report = env.last_pull
        assert report is not None and not report.changed
        ((root, why),) = report.refused
        assert root.endswith("proj") and "escape.txt" in why
        notes = env.execute("true").notes
        assert any("refused" in n and "nothing was applied" in n for n in notes)
    finally:
        env.close()
    assert env.last_pull is not None and env.last_pull.refused  # the pull at close was refused too
