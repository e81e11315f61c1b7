"""Property-based tests: glob filtering and archive-member validation."""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import tarfile
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hermes_env_core.errors import SyncError, UnsafeArchiveError
from hermes_env_core.sync import LocalDirTransport, PathFilter, SyncEngine, SyncMapping
from hermes_env_core.sync.archive import check_symlink, gnu_header, member_path
from hermes_env_core.sync.filters import scan_tree, translate_glob
from tests.sync._helpers import RecordingTransport, member, tar_bytes

# -- globs ------------------------------------------------------------------------

name_chars = st.sampled_from("ab.xy_")
names = st.text(name_chars, min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))
glob_chars = st.sampled_from(["a", "b", ".", "x", "*", "?", "[ab]", "[!a]", "["])
component_globs = st.lists(glob_chars, min_size=1, max_size=5).map("".join)


@given(component_globs, names)
def test_component_glob_agrees_with_fnmatch(pattern: str, name: str) -> None:
    ours = re.fullmatch(translate_glob(pattern), name, re.DOTALL) is not None
    assert ours == fnmatch.fnmatchcase(name, pattern)


paths = st.lists(names, min_size=1, max_size=4).map("/".join)


@given(paths)
def test_double_star_patterns(rel: str) -> None:
    parts = rel.split("/")
    assert re.fullmatch(translate_glob("**/" + parts[-1]), rel)
    assert re.fullmatch(translate_glob("**"), rel)
    if len(parts) > 1:
        assert re.fullmatch(translate_glob(parts[0] + "/**"), rel)
        assert not re.fullmatch(translate_glob("*"), rel)  # '*' never crosses '/'
        assert re.fullmatch(translate_glob(parts[0] + "/**/" + parts[-1]), rel)


filter_globs = st.lists(st.sampled_from(["a", "*.x", "b*", "a/**", "/ab", "**/y", "?", "x.?", "[ab]b"]), max_size=3)


@given(filter_globs, filter_globs, paths)
def test_excluded_directory_excludes_its_subtree(include, exclude, rel: str) -> None:
    filt = PathFilter(include=include, exclude=exclude)
    parts = rel.split("/")
    for i in range(1, len(parts)):
        if not filt.accepts("/".join(parts[:i]), is_dir=True):
            assert not filt.accepts(rel)
            assert not filt.accepts(rel, is_dir=True)


@given(filter_globs, paths)
def test_excluded_name_anywhere_excludes(exclude, rel: str) -> None:
    filt = PathFilter(exclude=exclude)
    if any(filt.excludes_name(p) for p in rel.split("/")):
        assert not filt.accepts(rel)


def _prefix_free(rels: list[str]) -> list[str]:
    out: list[str] = []
    for rel in sorted(set(rels), key=len):
        if not any(rel.startswith(o + "/") or o.startswith(rel + "/") for o in out):
            out.append(rel)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filter_globs, filter_globs, st.lists(st.lists(st.sampled_from(["a", "b", "ab", "c.x", ".git", "y", "node_modules"]), min_size=1, max_size=3).map("/".join), max_size=12))
def test_scan_keeps_exactly_what_the_filter_accepts(include, exclude, rels) -> None:
    rels = _prefix_free(rels)
    filt = PathFilter(include=include, exclude=tuple(exclude) + (".git", "node_modules"))
    with tempfile.TemporaryDirectory() as root:
        for rel in rels:
            p = Path(root, rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(rel)
        assert set(scan_tree(root, filt)) == {r for r in rels if filt.accepts(r)}


# -- archive members ------------------------------------------------------------------

components = st.sampled_from(["a", "b", "..", ".", "", "c d", "e\n"])
member_names = st.tuples(st.booleans(), st.lists(components, min_size=1, max_size=5)).map(
    lambda t: ("/" if t[0] else "") + "/".join(t[1])
)


@given(member_names)
def test_member_path_accepts_exactly_the_names_inside(name: str) -> None:
    unsafe = name.startswith("/") or ".." in name.split("/")
    try:
        rel = member_path(name)
    except UnsafeArchiveError as exc:
        assert unsafe
        assert repr(name) in str(exc)
        return
    assert not unsafe
    assert all(p not in ("", ".", "..") for p in rel.split("/")) or rel == ""
    root = "/srv/root"
    assert posixpath.normpath(posixpath.join(root, rel)).startswith(root)


safe_rels = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=4).map("/".join)
targets = st.tuples(st.booleans(), st.lists(st.sampled_from(["a", "b", "..", ".", ""]), min_size=1, max_size=6)).map(
    lambda t: ("/" if t[0] else "") + "/".join(t[1])
)


@given(safe_rels, targets)
def test_symlink_target_check_matches_lexical_resolution(rel: str, target: str) -> None:
    inside = bool(target) and not target.startswith("/")
    if inside:
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel) or ".", target))
        inside = resolved != rel  # a link to itself is refused too
        # Walk it as the check does: '..' past the root escapes even if it comes back.
        depth = len(rel.split("/")) - 1
        for comp in target.split("/"):
            if comp == "..":
                depth -= 1
                if depth < 0:
                    inside = False
                    break
            elif comp not in ("", "."):
                depth += 1
        inside = inside and resolved != ".." and not resolved.startswith("../")
    try:
        check_symlink(rel, target, lambda p: False)
    except UnsafeArchiveError:
        assert not inside
    else:
        assert inside


kinds = st.sampled_from([tarfile.REGTYPE, tarfile.REGTYPE, tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE])
link_targets = st.one_of(targets, st.sampled_from(["/etc", "/etc/passwd", "../../..", "a", "b/a"]))
# Mostly plausible names, so that links and files through links get exercised.
plausible_names = st.one_of(
    st.lists(st.sampled_from(["a", "b", "c", "a/b", "."]), min_size=1, max_size=3).map("/".join),
    member_names,
)
hostile_members = st.lists(st.tuples(plausible_names, kinds, link_targets, st.binary(max_size=40)), min_size=1, max_size=8)


def _inside(root: str, path: str) -> bool:
    real = os.path.realpath(path)
    return real == root or real.startswith(root + os.sep)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_members)
def test_pull_of_any_archive_stays_inside_the_tree(members) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        host = os.path.realpath(os.path.join(tmp, "host"))
        outside = os.path.join(tmp, "outside")
        os.makedirs(host)
        os.makedirs(outside)
        Path(host, "a").write_text("pushed")
        transport = RecordingTransport(LocalDirTransport(os.path.join(tmp, "remote")))
        engine = SyncEngine(transport, [SyncMapping(host, "/p")], lock_dir=os.path.join(tmp, "locks"))
        engine.push()
        archive = tar_bytes(*(
            member(name, data if kind == tarfile.REGTYPE else b"", type=kind, linkname=link)
            for name, kind, link, data in members
        ))
        transport.downloads.append(archive)
        before = sorted(os.walk(host))
        try:
            engine.pull()
        except UnsafeArchiveError:
            assert sorted(os.walk(host)) == before
        except SyncError:
            pass  # e.g. a duplicate path of another type; never a write outside
        assert os.listdir(outside) == []
        for dirpath, dirnames, filenames in os.walk(host):
            assert _inside(host, dirpath), dirpath  # nothing was written through a link
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                if os.path.islink(p):
                    target = os.readlink(p)
                    rel = os.path.relpath(p, host)
                    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
                    assert not target.startswith("/") and resolved != rel, (rel, target)
                    assert resolved != ".." and not resolved.startswith("../"), (rel, target)
                else:
                    assert os.path.isdir(p) or os.path.isfile(p), p  # no fifo, no device


# -- push headers ------------------------------------------------------------------


@given(
    st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"), min_size=1, max_size=120),
    st.integers(0, 0o777),
    st.integers(0, 2**40),
    st.integers(0, 2**35),
    st.sampled_from([tarfile.REGTYPE, tarfile.SYMTYPE]),
    st.text(st.sampled_from("ab/.ü"), max_size=110),
)
def test_fast_header_is_what_tarfile_writes(name, mode, size, mtime, typeflag, link) -> None:
    ti = tarfile.TarInfo(name)
    ti.mode, ti.size, ti.mtime, ti.type, ti.linkname = mode, size, mtime, typeflag, link
    want = ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
    assert gnu_header(name, mode, size, mtime, typeflag, link.encode()) == want
