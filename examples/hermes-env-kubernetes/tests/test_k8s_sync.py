"""File sync through tar over exec, with the core's sync engine: push before commands, pull back at close."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hermes_env_core.testing import wait_until


def test_push_before_commands_and_pull_back_at_close(emu: Any, make_env: Any, tmp_path: Path) -> None:
    src = tmp_path / "work"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)) * 64)
    os.chmod(src / "a.txt", 0o640)
    env = make_env(sync=({"host": str(src), "remote": "/srv/work"},), sync_interval_s=0)
    r = env.execute("cat /srv/work/a.txt; stat -c %a /srv/work/a.txt; md5sum < /srv/work/sub/b.bin")
    import hashlib

    digest = hashlib.md5((src / "sub" / "b.bin").read_bytes()).hexdigest()  # noqa: S324 - a checksum
    assert r.output == f"alpha\n640\n{digest}  -\n"
    (src / "a.txt").write_text("beta\n")
    (src / "sub" / "b.bin").unlink()
    assert env.execute("cat /srv/work/a.txt; ls /srv/work/sub").output == "beta\n"
    env.execute("echo made-in-pod > /srv/work/new.txt; echo changed > /srv/work/a.txt")
    env.close()
    assert (src / "new.txt").read_text() == "made-in-pod\n"
    assert (src / "a.txt").read_text() == "changed\n"


def test_recreated_pod_gets_the_files_again(emu: Any, make_env: Any, tmp_path: Path) -> None:
    src = tmp_path / "w"
    src.mkdir()
    (src / "f").write_text("data\n")
    env = make_env(sync=({"host": str(src), "remote": "/srv/w", "upload_only": True},), sync_interval_s=0)
    assert env.execute("cat /srv/w/f").output == "data\n"
    first = env.pod_name
    emu.delete_pod("default", first, 0)
    assert wait_until(lambda: all(p["metadata"]["name"] != first for p in emu.pods()), timeout=20)
    assert env.execute("cat /srv/w/f").output == "data\n"
    assert env.pod_name != first
