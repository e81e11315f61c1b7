"""Snapshots and forks on apptainer: a copy of the persistent overlay, through the core's snapshot_files hook."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest
from singularity_support import IMAGE_COMMANDS, build_rootfs
from hermes_env_singularity.backend import SingularityEnvironment
from hermes_env_singularity.runtime import Runtime, client_env
from hermes_env_singularity.snapshots import OVERLAY_KIND, OVERLAY_PART, overlay_path

from hermes_env_core import CorruptSnapshotError, UnsupportedOperation, create_environment
from hermes_env_core.cli import main as cli_main
from hermes_env_core.errors import HermesEnvError
from hermes_env_core.environment.snapshot import load_snapshot, snapshots_dir

SETUP = (
    "mkdir -p /root/proj && cd /root/proj && (umask 027; printf 'v1\\n' > f.txt) && ln -s f.txt link "
    "&& rm /marker && export GREETING='hi there' && greet() { echo \"greet $1\"; }"
)
CHECK = (
    'pwd; echo "$GREETING"; greet you; cat f.txt; stat -c "%n %F" link; cat link; stat -c %a f.txt; '
    "cat /marker 2>/dev/null || echo marker-deleted"
)
EXPECTED = "/root/proj\nhi there\ngreet you\nv1\nlink symbolic link\nv1\n640\nmarker-deleted\n"


@pytest.fixture(autouse=True)
def _store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture
def opts(sif: Path, tmp_path: Path) -> dict[str, object]:
    return dict(image=str(sif), overlay="persistent", overlay_dir=str(tmp_path / "ov"))


def _overlays(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def test_snapshot_then_change_then_start_from_it(opts: dict[str, object], tmp_path: Path) -> None:
    with SingularityEnvironment(**opts, task_id="src") as env:
        assert env.execute(SETUP).exit_code == 0
        snap = env.snapshot("ov1")
        assert snap.files.kind == OVERLAY_KIND and snap.files.parts == (OVERLAY_PART,) and snap.files.size > 0
        env.execute("printf 'v2\\n' > f.txt && echo new > added && export GREETING=changed")
        assert env.execute("cat f.txt").output == "v2\n"
    new = create_environment("singularity", snapshot="ov1", overlay_dir=opts["overlay_dir"])
    try:
        assert isinstance(new, SingularityEnvironment) and new.config.task_id != "src"
        r = new.execute(CHECK + "; test -e added && echo added-present || echo no-added")
        assert r.output == EXPECTED + "no-added\n"
        own = new.overlay_path
        assert own is not None and own != overlay_path(str(opts["overlay_dir"]), "src")
    finally:
        new.close()
    # The overlay made for it (no task_id given) went with it; the source's stays.
    assert _overlays(tmp_path / "ov") == [Path(overlay_path(str(opts["overlay_dir"]), "src")).name]


def test_fork_two_independent_overlays(opts: dict[str, object]) -> None:
    with SingularityEnvironment(**opts, task_id="fsrc") as env:
        assert env.execute(SETUP).exit_code == 0
        forks = env.fork(2)
        try:
            a, b = forks
            assert len({a.overlay_path, b.overlay_path, env.overlay_path}) == 3
            assert a.execute(CHECK).output == EXPECTED and b.execute(CHECK).output == EXPECTED
            assert a.execute("echo from-a > only-a && rm f.txt").exit_code == 0
            probe = "cat only-a 2>/dev/null || echo none; cat f.txt"
            assert b.execute(probe).output == "none\nv1\n"
            assert env.execute(probe).output == "none\nv1\n"
            assert a.execute(probe).output.startswith("from-a\n")
        finally:
            for f in forks:
                f.close()
        assert env.execute("cat f.txt").output == "v1\n"
    # A fork leaves no snapshot behind.
    assert not [p for p in snapshots_dir().iterdir() if not p.name.startswith(".")]


def test_corrupt_overlay_part_refused_whole(opts: dict[str, object], tmp_path: Path) -> None:
    with SingularityEnvironment(**opts, task_id="csrc") as env:
        env.execute(SETUP)
        snap = env.snapshot("bad")
    part = Path(str(snap.path)) / OVERLAY_PART
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    before = _overlays(tmp_path / "ov")
    with pytest.raises(CorruptSnapshotError, match=f"part {OVERLAY_PART} does not match its checksum"):
        create_environment("singularity", snapshot="bad", overlay_dir=opts["overlay_dir"])
    assert _overlays(tmp_path / "ov") == before  # no overlay made, no instance started


def test_unsafe_overlay_archive_refused(opts: dict[str, object], tmp_path: Path) -> None:
    """An archive whose checksum was recomputed still may not write outside the overlay."""
    with SingularityEnvironment(**opts, task_id="usrc") as env:
        snap = env.snapshot("unsafe")
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escape")
        tar.addfile(info)
    part = Path(str(snap.path)) / OVERLAY_PART
    part.write_bytes(evil.read_bytes())
    from hermes_env_singularity.snapshots import check_overlay_archive

    with pytest.raises(CorruptSnapshotError, match="unsafe path '../escape'"):
        check_overlay_archive(part, "test")


def test_rm_removes_the_parts(opts: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    with SingularityEnvironment(**opts, task_id="rsrc") as env:
        env.execute("echo x > /root/x")
        snap = env.snapshot("gone")
    assert (Path(str(snap.path)) / OVERLAY_PART).is_file()
    assert load_snapshot("gone").files.kind == OVERLAY_KIND
    assert cli_main(["snapshots", "rm", "gone"]) == 0
    assert not Path(str(snap.path)).exists()


@pytest.mark.parametrize("overlay", ["tmpfs", "none"])
def test_non_persistent_overlay_gets_a_clear_error(sif: Path, overlay: str) -> None:
    with SingularityEnvironment(image=str(sif), overlay=overlay) as env:
        env.execute("cd /tmp")
        with pytest.raises(UnsupportedOperation, match=rf"overlay='{overlay}'.*overlay='persistent'.*paths=.*files=False"):
            env.snapshot("nope")
        with pytest.raises(UnsupportedOperation, match="overlay='persistent'"):
            env.fork(1)
        assert not (snapshots_dir() / "nope").exists()


@pytest.fixture(scope="module")
def sif_with_tar(runtime: Runtime, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = build_rootfs(tmp_path_factory.mktemp("tar-rootfs") / "rootfs", commands=(*IMAGE_COMMANDS, "tar", "gzip", "mktemp"))
    out = root.parent / "tar.sif"
    proc = runtime.run(["build", "--force", str(out), str(root)], env=client_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_tmpfs_overlay_archives_declared_paths(sif_with_tar: Path, sif: Path) -> None:
    """paths=[...] takes the core's archive path, which runs tar in the target over its own bash."""
    with SingularityEnvironment(image=str(sif_with_tar), overlay="tmpfs") as env:
        env.execute("mkdir -p /tmp/keep && cd /tmp/keep && echo kept > k && export V=1")
        snap = env.snapshot("paths", paths=["/tmp/keep"])
        assert snap.files.kind == "archive"
    new = create_environment("singularity", snapshot="paths")
    try:
        r = new.execute('cat k; echo "$V"; pwd')
        assert r.output.startswith("kept\n1\n") and r.cwd != "/tmp/keep"
    finally:
        new.close()
    with SingularityEnvironment(image=str(sif), overlay="tmpfs") as env:
        env.execute("mkdir -p /tmp/keep")
        with pytest.raises(HermesEnvError, match="archiving /tmp/keep failed \\(the target has no tar\\)"):
            env.snapshot("notar", paths=["/tmp/keep"])


def test_start_with_a_used_task_id_is_refused(opts: dict[str, object]) -> None:
    with SingularityEnvironment(**opts, task_id="t1") as env:
        env.execute("echo a > /root/a")
        env.snapshot("taken")
    # t1's overlay holds files: starting from the snapshot there would mix two file trees.
    with pytest.raises(Exception, match="already holds files.*new task_id"):
        create_environment("singularity", snapshot="taken", overlay_dir=opts["overlay_dir"], task_id="t1")
    with create_environment("singularity", snapshot="taken", overlay_dir=opts["overlay_dir"], task_id="t2") as env2:
        assert env2.execute("cat /root/a").output == "a\n"
    # A task_id given by the caller keeps its overlay (persistent), as any persistent overlay.
    assert os.path.isdir(overlay_path(str(opts["overlay_dir"]), "t2"))
