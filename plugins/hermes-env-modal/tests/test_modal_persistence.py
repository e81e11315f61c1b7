"""persistent = true: a snapshot at close, restored by task id at the next start;
a failed restore is said in the next result and the base image is used."""

from __future__ import annotations

import json
import threading
import time
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


def test_snapshot_taken_with_an_explicit_timeout_and_ttl_and_its_expiry_recorded(fresh_modal_emu, tmp_path):
    store_path = tmp_path / "snaps.json"
    task = _task()
    opts = dict(mode="direct", task_id=task, persistent=True, snapshot_store=str(store_path), snapshot_ttl=3600)
    before = time.time()
    with ModalEnvironment(**opts):
        pass
    record = SnapshotStore(store_path).get(f"direct:{task}")
    assert record is not None and record.expires_at is not None
    assert before + 3600 <= record.expires_at <= time.time() + 3600
    assert fresh_modal_emu.images[record.image_id].ttl_seconds == 3600  # what the SDK sent


def test_an_expired_snapshot_is_skipped_with_a_note(fresh_modal_emu, tmp_path):
    store_path = tmp_path / "snaps.json"
    task = _task()
    opts = dict(mode="direct", task_id=task, persistent=True, snapshot_store=str(store_path))
    with ModalEnvironment(**opts) as env:
        env.execute("echo kept > ~/saved.txt")
    record = SnapshotStore(store_path).get(f"direct:{task}")
    assert record is not None
    # Rewrite its expiry into the past: what 30 days later looks like.
    data = json.loads(store_path.read_text())
    data["snapshots"][f"direct:{task}"]["expires_at"] = time.time() - 1
    store_path.write_text(json.dumps(data))
    with ModalEnvironment(**opts) as env:
        assert env.restored_from is None
        r = env.execute("cat ~/saved.txt")
        assert r.exit_code == 1
        (note,) = [n for n in r.notes if "expired" in n]
        assert record.image_id in note and "base image" in note


# -- managed: snapshots are kept by the gateway, by logicalKey ----------------------
def test_managed_persistence_is_the_gateways(fresh_gateway):
    task = _task()
    opts = dict(mode="managed", gateway_url=fresh_gateway.url, gateway_token=fresh_gateway.token, task_id=task,
                persistent=True, workdir="/root")
    with ModalEnvironment(**opts) as env:
        env.execute("echo kept > saved.txt")
        first = env.sandbox_id
    assert fresh_gateway.sandboxes[first].terminated_with_snapshot is True
    creates = [b for m, p, b in fresh_gateway.bodies if m == "POST" and p == "/v1/sandboxes"]
    assert creates[0]["persistentFilesystem"] is True and creates[0]["logicalKey"] == task
    with ModalEnvironment(**opts) as env:
        assert env.execute("cat saved.txt").output == "kept\n"
    with ModalEnvironment(**{**opts, "persistent": False}) as env:
        assert env.execute("cat saved.txt").exit_code == 1
        last = env.sandbox_id
    assert fresh_gateway.sandboxes[last].terminated_with_snapshot is False


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
