"""The snapshot_files / start_from_snapshot hook: a backend's own kind of files, stored, checked,
started from, forked and removed by the core, shown with a tiny backend built on the local one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from hermes_env_core import CorruptSnapshotError, FilesRef, HermesEnvError, Snapshot, create_environment
from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.cli import main as cli_main
from hermes_env_core.environment.base import BaseEnvironment
from hermes_env_core.environment.snapshot import load_snapshot, snapshots_dir
from hermes_env_core.plugins import BackendSpec, hookimpl
from hermes_env_core.plugins.registry import get_registry, reset_registry

PART = "tree.json"


class _Tiny(LocalEnvironment):
    """Its 'target files' are the working directory, captured as one JSON part."""

    name = "tinysnap"

    def snapshot_files(self, workdir: Path, name: str, *, paths: Sequence[str] | None, temporary: bool) -> FilesRef:
        root = self.session.cwd
        tree = {f: Path(root, f).read_text() for f in sorted(os.listdir(root)) if Path(root, f).is_file()}
        (workdir / PART).write_text(json.dumps({"root": root, "tree": tree}))
        return FilesRef("tiny-tree", roots=(root,), parts=(PART,))

    @classmethod
    def start_from_snapshot(
        cls, snapshot: Snapshot, options: dict[str, Any], create: Callable[..., BaseEnvironment]
    ) -> BaseEnvironment:
        data = json.loads(snapshot.part(PART).read_text())
        new = tempfile.mkdtemp(prefix="tiny-")
        for f, text in data["tree"].items():
            Path(new, f).write_text(text)
        return create(moved_dirs={data["root"]: new}, **options)


class _Bad(LocalEnvironment):
    name = "tinybad"

    def snapshot_files(self, workdir: Path, name: str, *, paths: Sequence[str] | None, temporary: bool) -> FilesRef:
        return FilesRef("archive", parts=("nothing",))


class _Plugin:
    @hookimpl
    def hermes_env_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(name=n, target=f"{__name__}:{c}", config_model="hermes_env_core.backends.local:LocalConfig")
            for n, c in (("tinysnap", "_Tiny"), ("tinybad", "_Bad"))
        ]


@pytest.fixture(autouse=True)
def _registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # restored trees of this test only
    reset_registry()
    get_registry().register(_Plugin(), distribution="tinysnap")
    yield
    reset_registry()


@pytest.fixture
def src(tmp_path: Path) -> Iterator[BaseEnvironment]:
    work = tmp_path / "work"
    work.mkdir()
    env = create_environment("tinysnap", cwd=str(work))
    env.execute("echo one > a.txt && export KEPT=yes && f() { echo fn; }")
    yield env
    env.close()


def test_own_kind_is_stored_checked_and_started_from(src: BaseEnvironment, tmp_path: Path) -> None:
    snap = src.snapshot("own")
    manifest = json.loads((Path(str(snap.path)) / "manifest.json").read_text())
    assert manifest["files"]["kind"] == "tiny-tree" and PART in manifest["parts"]
    src.execute("echo two > a.txt")
    with create_environment("tinysnap", snapshot="own") as new:
        r = new.execute('cat a.txt; echo "$KEPT"; f; pwd')
        out = r.output.splitlines()
        assert out[:3] == ["one", "yes", "fn"]
        assert out[3] != str(tmp_path / "work") and Path(out[3]).name.startswith("tiny-")
    # A changed part refuses the whole snapshot before the backend sees it.
    part = Path(str(snap.path)) / PART
    part.write_text(part.read_text().replace("one", "evil"))
    with pytest.raises(CorruptSnapshotError, match=f"part {PART} does not match its checksum"):
        create_environment("tinysnap", snapshot="own")
    assert cli_main(["snapshots", "rm", "own"]) == 0
    assert not Path(str(snap.path)).exists()


def test_fork_through_the_hook(src: BaseEnvironment) -> None:
    forks = src.fork(2)
    try:
        a, b = forks
        a.execute("echo changed > a.txt")
        assert b.execute("cat a.txt").output == "one\n"
        assert src.execute("cat a.txt").output == "one\n"
        assert a.execute("cat a.txt; f").output == "changed\nfn\n"
    finally:
        for f in forks:
            f.close()
    assert not [p for p in snapshots_dir().iterdir()]


def test_a_hook_may_not_claim_a_core_kind(tmp_path: Path) -> None:
    with create_environment("tinybad", cwd=str(tmp_path)) as env:
        env.execute("true")
        with pytest.raises(HermesEnvError, match="snapshot_files returned .*backend's own kind"):
            env.snapshot("bad")
    assert not [p for p in snapshots_dir().iterdir()]
    with pytest.raises(Exception, match="no snapshot named 'bad'"):
        load_snapshot("bad")
