"""Hostile archives fed to pull-back. Names that leave the tree are tampering:
the archive is refused, naming the member, and nothing on the host changes
(not even a temporary file). Entries that only cannot be applied safely (a
symlink leaving the tree, a fifo, a device) are skipped and reported by name,
and every other change is applied."""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

import pytest

from hermes_env_core.errors import UnsafeArchiveError
from hermes_env_core.sync import PullResult, SyncMapping
from tests.sync._helpers import member, snapshot, tar_bytes, write

GiB = 1024**3


@pytest.fixture
def pushed(host: Path, make_engine, transport):
    write(host / "a.txt", "original")
    write(host / "sub" / "b.txt", "original b")
    os.symlink("/etc", host / "etc-link-on-host")  # a host symlink that leaves the tree
    engine = make_engine()
    engine.push()
    return engine


def _refused(engine, transport, host: Path, archive: bytes, match: str) -> UnsafeArchiveError:
    before = snapshot(host)
    state = {rel: dict(s.hashes) for rel, s in enumerate(engine._maps)}
    transport.downloads.append(archive)
    with pytest.raises(UnsafeArchiveError, match=match) as info:
        engine.pull()
    assert snapshot(host) == before
    assert {rel: dict(s.hashes) for rel, s in enumerate(engine._maps)} == state
    # The caller gets a report too, and a note that says what happened.
    report = info.value.report
    assert isinstance(report, PullResult)
    assert not report.changed
    ((root, why),) = report.refused
    assert root == engine._maps[0].remote_path and why == str(info.value)
    assert len(report.notes) == 1 and "refused" in report.notes[0] and "nothing was applied" in report.notes[0]
    return info.value


def _skipped(engine, transport, host: Path, archive: bytes, names: dict[str, str]) -> PullResult:
    """The archive is applied except ``names`` (rel -> pattern of why), reported as skipped."""
    transport.downloads.append(archive)
    result = engine.pull()
    assert (host / "a.txt").read_bytes() == b"CHANGED BY REMOTE"  # the good change went through
    assert result.updated == (str(host / "a.txt"),)
    skipped = dict(result.skipped)
    assert set(skipped) == {str(host / rel) for rel in names}
    for rel, pattern in names.items():
        assert re.search(pattern, skipped[str(host / rel)]), skipped[str(host / rel)]
        assert any(str(host / rel) in note and "skipped" in note for note in result.notes)
    return result


def _with_good_change(*members):
    """A legitimate change first, so a partial apply would show."""
    return tar_bytes(member("./"  , type=tarfile.DIRTYPE), member("a.txt", b"CHANGED BY REMOTE"), *members)


def test_traversal(pushed, transport, host: Path) -> None:
    err = _refused(pushed, transport, host, _with_good_change(member("../escape.txt", b"x")), r"'\.\./escape\.txt'")
    assert not (host.parent / "escape.txt").exists()
    assert "'..'" in str(err)


def test_traversal_in_the_middle_of_a_path(pushed, transport, host: Path) -> None:
    _refused(pushed, transport, host, _with_good_change(member("sub/../../x", b"x")), r"sub/\.\./\.\./x")


def test_traversal_hidden_in_an_excluded_dir_is_still_refused(pushed, transport, host: Path) -> None:
    _refused(pushed, transport, host, _with_good_change(member("node_modules/../../x", b"x")), "node_modules")


def test_absolute_path(pushed, transport, host: Path) -> None:
    _refused(pushed, transport, host, _with_good_change(member("/etc/x", b"x")), r"'/etc/x'.*absolute")


def test_symlink_escape_then_file_through_it(pushed, transport, host: Path) -> None:
    archive = _with_good_change(
        member("evil", type=tarfile.SYMTYPE, linkname="/etc"),
        member("evil/passwd", b"root::0:0::/:/bin/sh\n"),
    )
    _refused(pushed, transport, host, archive, "evil")
    assert not (host / "evil").exists()


def test_relative_symlink_escape_is_skipped(pushed, transport, host: Path) -> None:
    archive = _with_good_change(member("sub/up", type=tarfile.SYMTYPE, linkname="../../.."))
    _skipped(pushed, transport, host, archive, {"sub/up": r"sub/up.*outside"})
    assert not os.path.lexists(host / "sub" / "up")


def test_absolute_symlink_of_a_virtualenv_is_skipped_and_the_rest_applied(pushed, transport, host: Path) -> None:
    archive = _with_good_change(
        member("venv/bin/python", type=tarfile.SYMTYPE, linkname="/usr/bin/python3"),
        member("venv/bin/activate", b"# activate\n"),
        member("sub/new.txt", b"new"),
    )
    result = _skipped(pushed, transport, host, archive, {"venv/bin/python": r"'/usr/bin/python3'.*absolute"})
    assert not os.path.lexists(host / "venv" / "bin" / "python")
    assert (host / "venv" / "bin" / "activate").read_bytes() == b"# activate\n"
    assert (host / "sub" / "new.txt").read_bytes() == b"new"
    assert sorted(result.created) == sorted(str(host / p) for p in ("venv/bin/activate", "sub/new.txt"))


def test_skipped_link_over_a_pushed_file_keeps_the_host_file(pushed, transport, host: Path) -> None:
    # The target replaced sub/b.txt with a link to /etc/passwd: the host keeps its
    # file (neither replaced nor deleted), and says so.
    archive = _with_good_change(member("sub/b.txt", type=tarfile.SYMTYPE, linkname="/etc/passwd"))
    _skipped(pushed, transport, host, archive, {"sub/b.txt": "absolute"})
    assert (host / "sub" / "b.txt").read_text() == "original b"


def test_symlink_chain_escape_is_skipped(pushed, transport, host: Path) -> None:
    # d1/d2/l1 -> ../.. is the root (fine); l2 -> d1/d2/l1/.. would be its parent.
    archive = _with_good_change(
        member("d1/d2/l1", type=tarfile.SYMTYPE, linkname="../.."),
        member("l2", type=tarfile.SYMTYPE, linkname="d1/d2/l1/.."),
    )
    _skipped(pushed, transport, host, archive, {"l2": r"'l2'.*through another symlink"})
    assert os.readlink(host / "d1" / "d2" / "l1") == "../.."
    assert not os.path.lexists(host / "l2")


def test_file_through_an_inner_symlink_is_refused(pushed, transport, host: Path) -> None:
    archive = _with_good_change(
        member("inner", type=tarfile.SYMTYPE, linkname="sub"),
        member("inner/b.txt", b"overwrite via link"),
    )
    _refused(pushed, transport, host, archive, r"'inner/b\.txt'.*under the symlink")


def test_write_through_a_host_symlink_is_refused(pushed, transport, host: Path) -> None:
    os.symlink("/etc", host / "late-link")  # made on the host after the push
    archive = _with_good_change(
        member("etc-link-on-host", type=tarfile.SYMTYPE, linkname="/etc"),
        member("late-link/hermes-test-file", b"x"),
    )
    _refused(pushed, transport, host, archive, "host symlink")
    assert not Path("/etc/hermes-test-file").exists()


def test_symlink_replaced_by_a_directory_in_the_target(pushed, transport, host: Path) -> None:
    # The target removed the pushed link and made a real directory there: the
    # host link (unchanged since the push) goes, nothing is written through it.
    archive = _with_good_change(member("etc-link-on-host/hermes-test-file", b"x"))
    transport.downloads.append(archive)
    result = pushed.pull()
    assert str(host / "etc-link-on-host") in result.deleted
    assert not (host / "etc-link-on-host").is_symlink()
    assert (host / "etc-link-on-host" / "hermes-test-file").read_bytes() == b"x"
    assert not Path("/etc/hermes-test-file").exists()


def test_hardlink_escape(pushed, transport, host: Path) -> None:
    _refused(pushed, transport, host, _with_good_change(member("h", type=tarfile.LNKTYPE, linkname="/etc/passwd")), "hard link 'h'")
    _refused(pushed, transport, host, _with_good_change(member("h", type=tarfile.LNKTYPE, linkname="../../etc/passwd")), r"'\.\./\.\./etc/passwd'")


def test_hardlink_to_a_name_not_in_the_archive(pushed, transport, host: Path) -> None:
    _refused(pushed, transport, host, _with_good_change(member("h", type=tarfile.LNKTYPE, linkname="sub/b.txt")), "earlier file")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_device_nodes_and_fifos_are_skipped(pushed, transport, host: Path, kind: bytes) -> None:
    ti, data = member("dev", type=kind)
    ti.devmajor, ti.devminor = 1, 3
    _skipped(pushed, transport, host, _with_good_change((ti, data)), {"dev": "(device file|fifo)"})
    assert not os.path.lexists(host / "dev")


def test_fifo_under_a_symlink_still_refuses_the_archive(pushed, transport, host: Path) -> None:
    ti, data = member("out/fifo", type=tarfile.FIFOTYPE)
    archive = _with_good_change(member("out", type=tarfile.SYMTYPE, linkname="/tmp"), (ti, data))
    _refused(pushed, transport, host, archive, r"'out/fifo'.*under the symlink 'out'")


def test_header_claiming_a_huge_size(pushed, transport, host: Path) -> None:
    ti, _ = member("bomb.bin", size=3 * GiB)
    archive = _with_good_change() [:-1024] + ti.tobuf(tarfile.GNU_FORMAT) + b"A" * 4096
    _refused(pushed, transport, host, archive, r"'bomb\.bin' \(3221225472 bytes\).*2147483648-byte cap")


def test_many_members_past_the_cap(host: Path, make_engine, transport) -> None:
    write(host / "a.txt", "original")
    engine = make_engine(max_archive_bytes=1024 * 1024)
    engine.push()
    chunks = [member(f"part{i:02}.bin", os.urandom(100 * 1024)) for i in range(15)]
    err = _refused(engine, transport, host, _with_good_change(*chunks), r"part10\.bin.*1048576-byte cap")
    assert "refusing" in str(err)


def test_too_many_members(host: Path, make_engine, transport) -> None:
    write(host / "a.txt", "original")
    engine = make_engine(max_members=50)
    engine.push()
    _refused(engine, transport, host, _with_good_change(*(member(f"e{i}") for i in range(60))), "more than 50 members")


def test_oversized_long_name_header_is_cut_off(pushed, transport, host: Path) -> None:
    # A GNU long-name record claiming 64 MiB: tarfile would buffer all of it.
    ti = tarfile.TarInfo("././@LongLink")
    ti.type = tarfile.GNUTYPE_LONGNAME
    ti.size = 64 * 1024 * 1024
    archive = _with_good_change()[:-1024] + ti.tobuf(tarfile.GNU_FORMAT) + b"n" * (40 * 1024 * 1024)
    _refused(pushed, transport, host, archive, "oversized headers")


def test_sparse_member_is_skipped(pushed, transport, host: Path) -> None:
    _skipped(pushed, transport, host, _with_good_change(member("s", type=tarfile.GNUTYPE_SPARSE)), {"s": "sparse file"})


def test_excluded_members_are_only_name_checked(pushed, transport, host: Path) -> None:
    # A virtualenv's absolute symlink inside an excluded dir does not block the pull.
    archive = _with_good_change(member(".venv/bin/python", type=tarfile.SYMTYPE, linkname="/usr/bin/python3"))
    transport.downloads.append(archive)
    result = pushed.pull()
    assert result.updated == (str(host / "a.txt"),)
    assert not (host / ".venv").exists()


def test_inner_symlinks_and_hardlinks_are_fine(pushed, transport, host: Path) -> None:
    archive = _with_good_change(
        member("sub/b.txt", b"original b"),
        member("sub/to-a", type=tarfile.SYMTYPE, linkname="../a.txt"),
        member("copy.txt", type=tarfile.LNKTYPE, linkname="a.txt"),
        member("copy-of-unchanged.txt", type=tarfile.LNKTYPE, linkname="sub/b.txt"),
        member("etc-link-on-host", type=tarfile.SYMTYPE, linkname="/etc"),  # unchanged: not rewritten
    )
    transport.downloads.append(archive)
    result = pushed.pull()
    assert sorted(result.created) == sorted(str(host / p) for p in ("sub/to-a", "copy.txt", "copy-of-unchanged.txt"))
    assert (host / "copy.txt").read_text() == "CHANGED BY REMOTE"
    assert (host / "copy-of-unchanged.txt").read_text() == "original b"
    assert os.readlink(host / "sub" / "to-a") == "../a.txt"
    assert not (host / "copy.txt").samefile(host / "a.txt")  # copies, not links


def test_refusal_of_one_mapping_leaves_the_others_untouched(host: Path, tmp_path: Path, make_engine, transport) -> None:
    other = tmp_path / "other"
    write(host / "a.txt", "a")
    write(other / "o.txt", "o")
    engine = make_engine(SyncMapping(host, "/work/proj"), SyncMapping(other, "/work/other"))
    engine.push()
    good = tar_bytes(member("a.txt", b"new a"))
    bad = tar_bytes(member("../../x", b"x"))
    before = (snapshot(host), snapshot(other))
    transport.downloads.extend([good, bad])
    with pytest.raises(UnsafeArchiveError) as info:
        engine.pull()
    assert (snapshot(host), snapshot(other)) == before
    assert [root for root, _ in info.value.report.refused] == ["/work/other"]
