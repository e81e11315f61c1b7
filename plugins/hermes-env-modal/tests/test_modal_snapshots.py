"""Snapshots and forks on modal (direct mode): the sandbox's filesystem as a Modal
filesystem snapshot (``Sandbox.snapshot_filesystem``), a new sandbox created from that
image, the session state restored by the core. Against the emulator, with the real SDK."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import modal
import modal.experimental
import pytest
from hermes_env_modal import ModalEnvironment
from hermes_env_modal.backend import MODAL_IMAGE_KIND

from hermes_env_core import CorruptSnapshotError, UnsupportedOperation, create_environment
from hermes_env_core.errors import UsageError
from hermes_env_core.cli import main as cli_main
from hermes_env_core.environment.snapshot import FilesRef, load_snapshot, snapshots_dir

SETUP = (
    "mkdir -p ~/proj && cd ~/proj && printf 'v1\\n' > f.txt && ln -s f.txt link "
    "&& export GREETING='hi there' && greet() { echo \"greet $1\"; }"
)
CHECK = 'pwd; echo "$GREETING"; greet you; cat f.txt; cat link; test -e added && echo added || echo no-added'


@pytest.fixture(autouse=True)
def _store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def _name() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


def _stored() -> list[str]:
    root = snapshots_dir()
    return sorted(p.name for p in root.iterdir())


def test_snapshot_then_change_then_start_from_it(modal_emu) -> None:
    name = _name()
    with ModalEnvironment(mode="direct") as env:
        assert env.execute(SETUP).exit_code == 0
        where = env.execute("pwd").output
        snap = env.snapshot(name)
        ref = snap.files.ref
        assert snap.files.kind == MODAL_IMAGE_KIND and snap.files.parts == () and ref is not None
        assert modal_emu.images[ref].source_sandbox == env.sandbox_id  # what snapshot_filesystem made
        assert modal_emu.images[ref].ttl_seconds == 30 * 24 * 3600  # snapshot_ttl's default, sent
        assert load_snapshot(name).files == snap.files  # the manifest holds the image id, no part
        assert env.execute("printf 'v2\\n' > f.txt && echo new > added && export GREETING=changed").exit_code == 0

        new = create_environment("modal", snapshot=name)
        try:
            assert new.sandbox_id != env.sandbox_id
            assert modal_emu.sandboxes[new.sandbox_id].image_id == ref
            r = new.execute(CHECK)
            assert r.output == f"{where}hi there\ngreet you\nv1\nv1\nno-added\n", r
            assert new.execute("echo from-new > f.txt").exit_code == 0
            assert env.execute('cat f.txt; echo "$GREETING"').output == "v2\nchanged\n"
            made = new.sandbox_id
        finally:
            new.close()
    assert modal_emu.sandboxes[made].finished  # its sandbox went with it


def test_a_snapshot_outlives_its_sandbox(modal_emu) -> None:
    name = _name()
    with ModalEnvironment(mode="direct") as env:
        env.execute(SETUP)
        first = env.sandbox_id
        env.snapshot(name)
    assert modal_emu.sandboxes[first].finished
    with create_environment("modal", snapshot=name) as new:
        assert new.execute('cat f.txt; echo "$GREETING"').output == "v1\nhi there\n"


def test_fork_two_independent_sandboxes(modal_emu) -> None:
    with ModalEnvironment(mode="direct") as env:
        assert env.execute(SETUP).exit_code == 0
        where = env.execute("pwd").output
        forks = env.fork(2)
        try:
            a, b = forks
            assert len({a.sandbox_id, b.sandbox_id, env.sandbox_id}) == 3
            images = {modal_emu.sandboxes[f.sandbox_id].image_id for f in forks}
            assert len(images) == 1  # one filesystem snapshot, two sandboxes
            (image,) = images
            assert modal_emu.images[image].source_sandbox == env.sandbox_id
            assert modal_emu.images[image].ttl_seconds == 24 * 3600  # a fork's image: a day at most
            expected = f"{where}hi there\ngreet you\nv1\nv1\nno-added\n"
            assert a.execute(CHECK).output == expected and b.execute(CHECK).output == expected
            assert a.execute("echo from-a > only-a && rm f.txt && export GREETING=a").exit_code == 0
            probe = 'cat only-a 2>/dev/null || echo none; cat f.txt; echo "$GREETING"'
            assert b.execute(probe).output == "none\nv1\nhi there\n"
            assert env.execute(probe).output == "none\nv1\nhi there\n"
            assert a.execute(probe).output.startswith("from-a\ncat: f.txt")
        finally:
            for f in forks:
                f.close()
    assert _stored() == []  # a fork leaves no snapshot behind


def test_deleted_image_is_a_clear_error(modal_emu) -> None:
    name = _name()
    with ModalEnvironment(mode="direct") as env:
        env.execute("echo x > kept")
        snap = env.snapshot(name)
    ref = snap.files.ref
    modal.experimental.image_delete(ref)
    before = len(modal_emu.sandboxes)
    with pytest.raises(CorruptSnapshotError, match=rf"Modal image {ref} is gone.*snapshots rm {name}"):
        create_environment("modal", snapshot=name)
    assert len(modal_emu.sandboxes) == before  # no sandbox made
    assert cli_main(["snapshots", "rm", name]) == 0
    assert _stored() == []


def test_unknown_image_id_is_a_clear_error(modal_emu) -> None:
    with ModalEnvironment(mode="direct") as env:
        env.execute("cd ~")
        snap = env.snapshot(_name())
    unknown = "im-emu0123456789abcdef0123"
    bad = dataclasses.replace(snap, files=FilesRef(MODAL_IMAGE_KIND, ref=unknown), path=None)
    with pytest.raises(CorruptSnapshotError, match=rf"Modal image {unknown} is gone"):
        create_environment("modal", snapshot=bad)
    no_ref = dataclasses.replace(snap, files=FilesRef(MODAL_IMAGE_KIND), path=None)
    with pytest.raises(CorruptSnapshotError, match="naming a Modal image"):
        create_environment("modal", snapshot=no_ref)


def test_persistent_task_with_its_own_snapshot_is_refused_not_mixed(modal_emu, tmp_path: Path) -> None:
    name, store = _name(), str(tmp_path / "store.json")
    task = f"t-{uuid.uuid4().hex[:8]}"
    with ModalEnvironment(mode="direct") as env:
        env.execute("echo from-snapshot > f.txt")
        env.snapshot(name)
    with ModalEnvironment(mode="direct", task_id=task, persistent=True, snapshot_store=store) as env:
        env.execute("echo from-task > f.txt")
    before = len(modal_emu.sandboxes)
    with pytest.raises(UsageError, match=rf"task {task!r} already has a persistent snapshot.*another task_id"):
        create_environment("modal", snapshot=name, task_id=task, persistent=True, snapshot_store=store)
    assert len(modal_emu.sandboxes) == before
    # A new task id starts from the snapshot, and keeps its files from then on.
    new_task = task + "-b"
    with create_environment("modal", snapshot=name, task_id=new_task, persistent=True, snapshot_store=store) as env:
        assert env.execute("cat f.txt").output == "from-snapshot\n"
        env.execute("echo changed > f.txt")
    with ModalEnvironment(mode="direct", task_id=new_task, persistent=True, snapshot_store=store) as env:
        assert env.execute("cat f.txt").output == "changed\n"


def test_paths_take_the_cores_archives(modal_emu) -> None:
    """paths=[...]: the core's archive, made by tar in the sandbox, unpacked into a new one."""
    with ModalEnvironment(mode="direct") as env:
        env.execute("mkdir -p ~/keep && cd ~/keep && echo kept > k && export V=1")
        before = modal_emu.call_count("TaskSnapshotFilesystem")
        snap = env.snapshot(_name(), paths=[env.execute("pwd").output.strip()])
        assert snap.files.kind == "archive" and len(snap.files.parts) == 1
        assert modal_emu.call_count("TaskSnapshotFilesystem") == before
        with create_environment("modal", snapshot=snap) as new:
            assert new.execute('cat k; echo "$V"').output == "kept\n1\n"


# -- managed mode -----------------------------------------------------------------------
def test_managed_mode_says_what_works_instead(gateway, modal_emu) -> None:
    opts = dict(mode="managed", gateway_url=gateway.url, gateway_token=gateway.token)
    with ModalEnvironment(**opts) as env:
        env.execute("cd /tmp && export KEEP=1")
        with pytest.raises(UnsupportedOperation, match=r"mode='managed'.*mode='direct'.*files=False"):
            env.snapshot("nope")
        with pytest.raises(UnsupportedOperation, match="mode='direct'"):
            env.fork(1)
        assert not (snapshots_dir() / "nope").exists()
        state_only = env.snapshot(_name(), files=False)
        assert state_only.files.kind == "none"
    # A direct snapshot's image cannot start in managed mode.
    name = _name()
    with ModalEnvironment(mode="direct") as env:
        env.snapshot(name)
    with pytest.raises(UnsupportedOperation, match=rf"snapshot {name!r} holds a Modal image.*mode='direct'"):
        create_environment("modal", snapshot=name, **opts)
