"""A pull-back that fails loses nothing: what the engine knew is kept (in the
journal on disk), pushes refuse to overwrite the target's changes, and a later
pull, by this engine or by a new one, brings them back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hermes_env_core.errors import SyncConflictError, SyncError
from hermes_env_core.sync import CONFLICT_MARKER, SyncJournal, SyncMapping
from hermes_env_core.sync.transport import TransportError
from tests.sync._helpers import bump, write


def _fail_downloads(transport, error: Exception) -> list[int]:
    seen: list[int] = []

    def hook(op: str, args: tuple) -> None:
        if op == "download":
            seen.append(1)
            raise error

    transport.hooks.append(hook)
    return seen


@pytest.fixture
def journal(tmp_path: Path) -> SyncJournal:
    return SyncJournal("test:target", tmp_path / "journal")


def test_failed_pull_is_kept_and_the_next_engine_refuses_to_push(host: Path, remote: Path, transport, make_engine, journal) -> None:
    write(host / "a.txt", "host v1\n")
    write(host / "b.txt", "b\n")
    first = make_engine(journal=journal)
    first.push()
    write(remote / "a.txt", "edited in the target\n")
    _fail_downloads(transport, TransportError("connection reset", transient=False))
    with pytest.raises(SyncError, match="pull-back failed: connection reset.*pushes are refused") as failed:
        first.pull()
    assert str(journal.directory) in str(failed.value)
    assert not isinstance(failed.value, SyncConflictError)
    # The same engine refuses too, and names the mapping and the cause.
    with pytest.raises(SyncConflictError, match="connection reset") as refused:
        first.push(force=True)
    assert str(host) in str(refused.value) and refused.value.pending
    files = list(journal.directory.iterdir())
    assert len(files) == 1 and files[0].stat().st_mode & 0o077 == 0
    assert journal.directory.stat().st_mode & 0o077 == 0
    transport.hooks.clear()
    uploads = transport.count("upload")

    second = make_engine(journal=journal)  # the next CLI call: a new engine, same target
    assert [p.host for p in second.pending] == [os.path.realpath(host)]
    bump(host / "b.txt", "b changed on the host\n")
    with pytest.raises(SyncConflictError, match="pull them first|Pull them first"):
        second.push(force=True)
    assert transport.count("upload") == uploads  # nothing was sent
    assert (remote / "a.txt").read_text() == "edited in the target\n"

    result = second.pull()
    assert (host / "a.txt").read_text() == "edited in the target\n"
    assert [os.path.basename(p) for p in result.updated] == ["a.txt"]
    assert not second.pending and not list(journal.directory.iterdir())
    pushed = second.push(force=True)  # allowed again, and sends only the host's own change
    assert pushed.uploaded == ("/work/proj/b.txt",)
    assert (remote / "a.txt").read_text() == "edited in the target\n"
    assert (remote / "b.txt").read_text() == "b changed on the host\n"


def test_kept_records_let_the_later_pull_see_deletions_and_conflicts(host: Path, remote: Path, transport, make_engine, journal) -> None:
    for name in ("keep.txt", "gone.txt", "both.txt"):
        write(host / name, f"{name} v1\n")
    first = make_engine(journal=journal)
    first.push()
    (remote / "gone.txt").unlink()
    write(remote / "both.txt", "target version\n")
    _fail_downloads(transport, TransportError("tar died", transient=False))
    with pytest.raises(SyncError):
        first.pull()
    transport.hooks.clear()
    bump(host / "both.txt", "host version\n")

    result = make_engine(journal=journal).pull()
    # Only the records (what was pushed) tell a deletion in the target from a file never pushed.
    assert not (host / "gone.txt").exists() and result.deleted == (str(host / "gone.txt"),)
    assert (host / "both.txt").read_text() == "target version\n"
    (conflict,) = result.conflicts
    assert conflict.backup and CONFLICT_MARKER in conflict.backup
    assert Path(conflict.backup).read_text() == "host version\n"
    assert (host / "keep.txt").read_text() == "keep.txt v1\n"


def test_transient_failures_are_retried_then_kept(host: Path, remote: Path, transport, make_engine, journal) -> None:
    write(host / "a.txt", "1\n")
    engine = make_engine(journal=journal)
    engine.push()
    seen = _fail_downloads(transport, TransportError("socket closed", transient=True))
    with pytest.raises(SyncError, match="after 4 attempts"):
        engine.pull()
    assert len(seen) == 4  # bounded: the retry policy's attempts, then it is kept
    assert len(engine.pending) == 1


def test_without_a_journal_the_refusal_lives_in_the_engine(host: Path, remote: Path, transport, make_engine, journal) -> None:
    write(host / "a.txt", "1\n")
    engine = make_engine()
    engine.push()
    _fail_downloads(transport, OSError("disk gone"))
    with pytest.raises(SyncError):
        engine.pull()
    with pytest.raises(SyncConflictError):
        engine.push(force=True)
    transport.hooks.clear()
    engine.pull()
    assert engine.push(force=True).skipped is False


def test_upload_only_mappings_are_not_held_back(host: Path, remote_base: Path, transport, make_engine, journal, tmp_path: Path) -> None:
    secret = write(tmp_path / "netrc", "machine x\n")
    engine = make_engine(SyncMapping(secret, "/home/.netrc", upload_only=True), journal=journal)
    engine.push()
    _fail_downloads(transport, TransportError("boom", transient=False))
    engine.pull()  # nothing to download: an upload-only mapping is never pulled
    assert not engine.pending
    assert engine.push(force=True).skipped is False


def test_an_unreadable_record_still_refuses(host: Path, remote: Path, transport, make_engine, journal) -> None:
    write(host / "a.txt", "1\n")
    engine = make_engine(journal=journal)
    engine.push()
    _fail_downloads(transport, TransportError("boom", transient=False))
    with pytest.raises(SyncError):
        engine.pull()
    (record,) = journal.directory.iterdir()
    data = json.loads(record.read_text())
    assert data["hashes"] and data["reason"] == "boom"
    record.write_text("{not json")
    with pytest.raises(SyncConflictError, match="cannot be read"):
        make_engine(journal=journal).push(force=True)
