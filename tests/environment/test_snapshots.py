"""Snapshots and forks on the local backend, secrets, the state round trip, and bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import secrets
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hermes_env_core import (
    CorruptSnapshotError,
    Snapshot,
    SnapshotNotFoundError,
    UnsupportedOperation,
    UsageError,
    create_environment,
)
from hermes_env_core.backends.local import LocalEnvironment, carries_url_password
from hermes_env_core.cli import main as cli_main
from hermes_env_core.environment.session import SessionState, ansi_c_quote
from hermes_env_core.environment.snapshot import load_snapshot, state_from_json, state_to_json

SETUP = (
    "mkdir -p proj/sub && cd proj/sub && printf 'hello\\n' > note.txt && export GREETING='hi there' "
    "&& COUNT=7 && greet() { echo \"greet $1 $GREETING\"; } && alias ll='echo aliased-ll' && set -o noclobber"
)
CHECK = 'pwd; echo "$GREETING/$COUNT"; greet you; ll; cat note.txt; [[ -o noclobber ]] && echo noclobber'


@pytest.fixture(autouse=True)
def _store(tmp_path, monkeypatch):
    """Snapshots and restored trees of this test only."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def _restored_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("hermes-env-restore-*"))


@pytest.mark.parametrize("channel", [True, False], ids=["server", "process"])
def test_local_snapshot_restores_state_and_files(tmp_path, _store, channel):
    work = tmp_path / "work"
    work.mkdir()
    with create_environment("local", cwd=str(work), channel=channel) as env:
        assert env.execute(SETUP).exit_code == 0
        snap = env.snapshot("one")
        assert isinstance(snap, Snapshot) and snap.backend == "local" and snap.files.kind == "archive"
        assert snap.files.roots == (str(work / "proj" / "sub"),)
        env.execute("echo changed >| note.txt; GREETING=later")
    with create_environment("local", snapshot="one", channel=channel) as new:
        r = new.execute(CHECK)
        [fresh] = _restored_dirs(_store)
        assert r.output.splitlines() == [
            str(fresh), "hi there/7", "greet you hi there", "aliased-ll", "hello", "noclobber",
        ]
        assert any("restored into" in n and str(fresh) in n for n in r.notes)
        new.execute("echo mine >| note.txt")
    assert (work / "proj" / "sub" / "note.txt").read_text() == "changed\n"  # the original is untouched
    assert _restored_dirs(_store) == []  # the fresh directory went with the environment


def test_restore_to_a_chosen_directory_is_kept(tmp_path):
    with create_environment("local", cwd=str(tmp_path)) as env:
        env.execute("mkdir w && cd w && echo x > f && export V=1")
        env.snapshot("kept")
    dest = tmp_path / "dest"
    with create_environment("local", snapshot="kept", restore_to=str(dest)) as new:
        assert new.execute('pwd; cat f; echo "$V"').output == f"{dest}\nx\n1\n"
    assert (dest / "f").read_text() == "x\n"
    (dest / "other").write_text("")
    with pytest.raises(UsageError, match="new or empty directory"):
        create_environment("local", snapshot="kept", restore_to=str(dest))


def test_declared_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with create_environment("local", cwd=str(tmp_path)) as env:
        env.execute(f"mkdir {a} {b} && echo A > {a}/fa && echo B > {b}/fb && cd {b}")
        snap = env.snapshot("two", paths=[str(a), str(b)])
    assert snap.files.roots == (str(a), str(b))
    with create_environment("local", snapshot=snap) as new:
        out = new.execute("pwd; cat fb ../0-a/fa").output.splitlines()
        assert out[0].endswith("/1-b") and out[1:] == ["B", "A"]


def _all_bytes(path: Path) -> bytes:
    out = b""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            out += data + (gzip.decompress(data) if p.suffix == ".gz" else b"")
    return out


def test_secrets_stay_out_of_the_snapshot(tmp_path, monkeypatch):
    token, password, option_secret = (secrets.token_hex(8) for _ in range(3))
    with create_environment("local", cwd=str(tmp_path), env={"API_TOKEN": option_secret, "PLAIN": "p"}) as env:
        env.execute(
            f"export GITHUB_TOKEN=tok{token} DB_URL='postgres://u:pw{password}@db/x' KEEP=kept; "
            f"echo $GITHUB_TOKEN >/dev/null"
        )
        snap = env.snapshot("sec")
        assert set(snap.omitted) >= {"GITHUB_TOKEN", "DB_URL", "API_TOKEN"}
        assert env.execute("echo $GITHUB_TOKEN").output == f"tok{token}\n"  # the session itself keeps them
    blob = _all_bytes(Path(snap.path))
    assert b"kept" in blob and b"PLAIN" in blob
    for value in (token, password, option_secret):
        assert value.encode() not in blob
    # The new session has neither; its own environment's secret-looking variables are left alone.
    monkeypatch.setenv("OTHER_TOKEN", "own")
    with create_environment("local", snapshot="sec", env_passthrough=("OTHER_TOKEN",)) as new:
        assert new.execute('echo "[$GITHUB_TOKEN][$DB_URL][$KEEP][$OTHER_TOKEN]"').output == "[][][kept][own]\n"


def test_fork_sessions_diverge(tmp_path, _store):
    with create_environment("local", cwd=str(tmp_path)) as env:
        env.execute("mkdir t && cd t && echo base > f && N=0 && inc() { N=$((N+1)); }")
        forks = env.fork(3)
        try:
            assert len({e.execute("pwd").output for e in forks}) == 3
            for i, e in enumerate(forks):
                for _ in range(i + 1):
                    e.execute("inc")
                e.execute(f"echo fork{i} > f; export WHO={i}")
            for i, e in enumerate(forks):
                assert e.execute('echo "$N $WHO"; cat f').output == f"{i + 1} {i}\nfork{i}\n"
            assert env.execute('echo "$N [${WHO-}]"; cat f').output == "0 []\nbase\n"
        finally:
            for e in forks:
                e.close()
    assert _restored_dirs(_store) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40))
def test_odd_values_round_trip_through_a_snapshot(tmp_path, value):
    work = tmp_path / "w"
    work.mkdir(exist_ok=True)
    assume(not carries_url_password(value))
    name = "rt-" + secrets.token_hex(4)
    with create_environment("local", cwd=str(work)) as env:
        r = env.execute(f"declare -x ODD={ansi_c_quote(value)}; declare -a ARR=({ansi_c_quote(value)} x)")
        assert r.exit_code == 0, r.output
        snap = env.snapshot(name)
    assert state_from_json(snap.state_text) == snap.state
    with create_environment("local", snapshot=name) as new:
        out = new.execute('printf "%s\\0%s\\0%s" "$ODD" "${ARR[0]}" "${ARR[1]}"').output
    assert out.split("\0") == [value, value, "x"]


@given(
    names=st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), st.text(max_size=20), max_size=5),
    funcs=st.text(max_size=30),
    status=st.integers(0, 255),
    last=st.one_of(st.none(), st.text(max_size=10)),
)
def test_state_json_round_trip(names, funcs, status, last):
    state = SessionState(
        variables={n: f"declare -x {n}={json.dumps(v)}" for n, v in names.items()}, functions=funcs,
        shellopts=frozenset({"braceexpand", "noclobber"}), traps=(("INT", "trap -- 'x' INT"),),
        ulimits=(("n", "1024", "4096"),), last_status=status, last_arg=last, fds=(3, 9), cpu_times=(0.5, 0.25),
    )
    assert state_from_json(state_to_json(state)) == state


# -- bad input -----------------------------------------------------------------------------------
class _NoFilesEnvironment(LocalEnvironment):
    """A real backend (bash on this machine) that declares no way to snapshot its files."""

    name = "nofiles"


def test_backend_without_file_snapshots_says_what_it_supports():
    with _NoFilesEnvironment() as env:
        env.execute("export X=1")
        with pytest.raises(UnsupportedOperation) as e:
            env.snapshot("x")
        msg = str(e.value)
        assert "'nofiles'" in msg and "local, ssh, docker" in msg and "files=False" in msg
        with pytest.raises(UnsupportedOperation, match="'nofiles' cannot fork"):
            env.fork(2)
        env.execute("cd /")
        snap = env.snapshot("stateonly", files=False)
    assert snap.files.kind == "none" and '"X"' in snap.state_text
    with create_environment("local", snapshot=snap) as new:
        assert new.execute('pwd; echo "$X"').output == "/\n1\n"


def test_unknown_and_deleted_names_list_what_exists(tmp_path):
    with create_environment("local", cwd=str(tmp_path)) as env:
        env.snapshot("alpha")
        env.snapshot("beta")
        with pytest.raises(UsageError, match="already exists"):
            env.snapshot("alpha")
        with pytest.raises(UsageError, match="not valid"):
            env.snapshot("../evil")
    with pytest.raises(SnapshotNotFoundError, match=r"'gamma'.*alpha, beta"):
        create_environment("local", snapshot="gamma")
    assert cli_main(["snapshots", "rm", "alpha"]) == 0
    with pytest.raises(SnapshotNotFoundError, match=r"'alpha'.*exist: beta\)"):
        create_environment("local", snapshot="alpha")
    assert cli_main(["snapshots", "rm", "alpha"]) == 2
    with pytest.raises(UsageError, match="taken on backend 'local'"):
        create_environment("docker", snapshot="beta")


def test_cli_lists_snapshots(tmp_path, capsys):
    with create_environment("local", cwd=str(tmp_path)) as env:
        env.snapshot("listed")
    assert cli_main(["snapshots"]) == 0
    out = capsys.readouterr().out
    assert "listed" in out and "local" in out and str(tmp_path) in out
    assert cli_main(["snapshots", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["name"] == "listed" and row["files"] == "archive"


def _rewrite_manifest(path: Path, edit) -> None:
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    text = json.dumps(m, sort_keys=True, indent=1).encode()
    (path / "manifest.json").write_bytes(text)
    (path / "manifest.sha256").write_text(hashlib.sha256(text).hexdigest() + "\n")


def _truncate_and_resum(path: Path) -> None:
    part = path / "files-0.tar.gz"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])

    def fix(m):
        m["parts"]["files-0.tar.gz"] = {"sha256": hashlib.sha256(part.read_bytes()).hexdigest(), "size": part.stat().st_size}

    _rewrite_manifest(path, fix)


CORRUPTIONS = {
    "state edited": (lambda p: (p / "state.json").write_text((p / "state.json").read_text().replace("kept", "kepT")),
                     "state.json does not match its checksum"),
    "archive truncated": (lambda p: (p / "files-0.tar.gz").write_bytes((p / "files-0.tar.gz").read_bytes()[:-20]),
                          "files-0.tar.gz does not match"),
    "archive truncated, checksums redone": (_truncate_and_resum, "damaged or truncated"),
    "manifest edited": (lambda p: (p / "manifest.json").write_text((p / "manifest.json").read_text().replace('"local"', '"ssh"')),
                        "manifest does not match its checksum"),
    "manifest edited, checksum redone": (lambda p: _rewrite_manifest(p, lambda m: m["parts"].pop("files-0.tar.gz")),
                                         "parts do not match its manifest"),
    "part missing": (lambda p: (p / "state.json").unlink(), "parts do not match its manifest"),
    "unsafe member": (None, "unsafe path"),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_corrupt_snapshot_is_refused_whole(tmp_path, _store, how):
    work = tmp_path / "w"
    work.mkdir()
    (work / "big").write_bytes(os.urandom(50_000))
    with create_environment("local", cwd=str(work)) as env:
        env.execute("export KEEP=kept")
        snap = env.snapshot("bad")
    path = Path(snap.path)
    damage, message = CORRUPTIONS[how]
    if damage is None:
        import tarfile

        with tarfile.open(path / "files-0.tar.gz", "w:gz") as tar:
            info = tarfile.TarInfo("../escape")
            tar.addfile(info)
        _rewrite_manifest(path, lambda m: m["parts"].update({"files-0.tar.gz": {
            "sha256": hashlib.sha256((path / "files-0.tar.gz").read_bytes()).hexdigest(),
            "size": (path / "files-0.tar.gz").stat().st_size}}))
    else:
        damage(path)
    before = set(_store.iterdir())
    with pytest.raises(CorruptSnapshotError, match=message):
        create_environment("local", snapshot="bad")
    with pytest.raises(CorruptSnapshotError):
        load_snapshot("bad")
    with pytest.raises(CorruptSnapshotError):
        create_environment("local", snapshot=snap)  # the record in hand is checked against its files too
    assert set(_store.iterdir()) == before  # nothing unpacked, no environment made
    assert not (tmp_path / "escape").exists()
    assert cli_main(["snapshots"]) == 0  # listed as refused, and still removable
    assert cli_main(["snapshots", "rm", "bad"]) == 0
    assert not path.exists()


_DIR_NAME = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/"), min_size=1, max_size=20
).filter(lambda s: s not in (".", ".."))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(one=_DIR_NAME, two=_DIR_NAME)
def test_oldpwd_and_the_directory_stack_move_with_the_files(tmp_path, one, two):
    assume(one != two)
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    (work / one).mkdir()
    (work / two).mkdir()
    name = "dirs-" + secrets.token_hex(4)
    with create_environment("local", cwd=str(work)) as env:
        q1, q2 = ansi_c_quote(f"{work}/{one}"), ansi_c_quote(f"{work}/{two}")
        # in `one`, came from `two`, with /usr (outside the snapshot) and `two` on the stack
        r = env.execute(f"cd {q2} && pushd /usr >/dev/null && pushd {q1} >/dev/null && cd {q2} && cd {q1}; (exit 9)")
        assert r.exit_code == 9, r.output
        env.snapshot(name, paths=[str(work)])
    with create_environment("local", snapshot=name) as new:
        out = new.execute('printf "%s\\0" "$?" "$PWD" "$OLDPWD" "${DIRSTACK[@]}"').output.split("\0")[:-1]
        [fresh] = _restored_dirs(Path(tempfile.gettempdir()))
    # the first entry of DIRSTACK is $PWD itself
    assert out == ["9", f"{fresh}/{one}", f"{fresh}/{two}", f"{fresh}/{one}", "/usr", f"{fresh}/{two}"]
