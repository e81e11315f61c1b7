"""persistent = true: a snapshot at close, restored by task id at the next start;
a failed restore is said in the next result and the base image is used."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from hermes_env_modal import ModalEnvironment
from hermes_env_modal.snapshots import SnapshotStore


def _task() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"


# -- direct ----------------------------------------------------------------------
def test_snapshot_at_close_and_restore_at_next_start(fresh_modal_emu, tmp_path):
    store_path = tmp_path / "snaps.json"
    task = _task()
    opts = dict(mode="direct", task_id=task, persistent=True, snapshot_store=str(store_path))
    with ModalEnvironment(**opts) as env:
        assert env.restored_from is None
        env.execute("mkdir -p ~/work && echo kept > ~/work/file.txt")
        first = env.sandbox_id
    assert fresh_modal_emu.sandboxes[first].finished  # terminated after the snapshot
    record = SnapshotStore(store_path).get(f"direct:{task}")
    assert record is not None and record.image_id in fresh_modal_emu.images and record.sandbox_id == first
    assert json.loads(store_path.read_text())["version"] == 1

    with ModalEnvironment(**opts) as env:
        assert env.restored_from == record.image_id
        assert fresh_modal_emu.sandboxes[env.sandbox_id].image_id == record.image_id
        r = env.execute("cat ~/work/file.txt")
        assert r.output == "kept\n" and r.notes == ()


def test_restore_failure_is_in_the_next_result_and_the_base_image_used(fresh_modal_emu, tmp_path):
    store_path = tmp_path / "snaps.json"
    task = _task()
    SnapshotStore(store_path).put(f"direct:{task}", "im-emu-no-such-image")
    with ModalEnvironment(mode="direct", task_id=task, persistent=True, snapshot_store=str(store_path)) as env:
        assert env.restored_from is None
        r = env.execute("ls ~")
        assert r.exit_code == 0 and r.output == ""
        (note,) = [n for n in r.notes if "could not restore" in n]
        assert "im-emu-no-such-image" in note and "base image" in note
        assert env.execute("true").notes == ()  # said once


def test_not_persistent_means_no_snapshot(fresh_modal_emu, tmp_path):
    with ModalEnvironment(mode="direct", task_id=_task(), snapshot_store=str(tmp_path / "s.json")):
        pass
    assert fresh_modal_emu.call_count("TaskSnapshotFilesystem") == 0
    assert not (tmp_path / "s.json").exists()


def test_persistent_needs_a_task_id():
    with pytest.raises(ValueError, match="task_id"):
        ModalEnvironment(mode="direct", persistent=True)


# -- managed ---------------------------------------------------------------------
def test_managed_snapshot_restore_and_restore_failure(fresh_gateway, tmp_path):
    store_path = tmp_path / "snaps.json"
    task = _task()
    opts = dict(
        mode="managed", gateway_url=fresh_gateway.url, gateway_token=fresh_gateway.token,
        task_id=task, persistent=True, snapshot_store=str(store_path),
    )
    with ModalEnvironment(**opts) as env:
        env.execute("echo kept > saved.txt")
    record = SnapshotStore(store_path).get(f"managed:{fresh_gateway.url}:{task}")
    assert record is not None
    with ModalEnvironment(**opts) as env:
        assert env.restored_from == record.image_id
        r = env.execute("cat saved.txt")
        assert r.output == "kept\n" and r.notes == ()
    newer = SnapshotStore(store_path).get(f"managed:{fresh_gateway.url}:{task}")
    assert newer is not None and newer.image_id != record.image_id
    fresh_gateway.forget_image(newer.image_id)
    with ModalEnvironment(**opts) as env:
        r = env.execute("cat saved.txt")
        assert r.exit_code == 1
        assert any("could not restore" in n and newer.image_id in n for n in r.notes)


# -- the store -----------------------------------------------------------------------
def test_store_survives_concurrent_writers(tmp_path):
    path = tmp_path / "nested" / "snaps.json"

    def put(i: int) -> None:
        SnapshotStore(path).put(f"k{i}", f"im-{i}")

    threads = [threading.Thread(target=put, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = SnapshotStore(path)
    assert all(store.get(f"k{i}").image_id == f"im-{i}" for i in range(20))  # type: ignore[union-attr]
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_a_corrupt_store_does_not_stop_a_start(tmp_path):
    path = tmp_path / "snaps.json"
    path.write_text("{not json")
    assert SnapshotStore(path).get("anything") is None
    SnapshotStore(path).put("k", "im-1")
    assert SnapshotStore(path).get("k").image_id == "im-1"  # type: ignore[union-attr]
