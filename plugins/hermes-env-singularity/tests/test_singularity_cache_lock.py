"""Two processes asking for the same uncached image build it once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hermes_env_singularity.runtime import Runtime
from singularity_support import PLUGIN_ROOT

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from hermes_env_singularity.images import ensure_sif
from hermes_env_singularity.runtime import Runtime, client_env
print("ready", flush=True)
sys.stdin.readline()  # both start together
r = ensure_sif(sys.argv[2], Runtime(sys.argv[3]), cache_dir=sys.argv[4], env=client_env(), build_timeout=600)
print(json.dumps({"source": r.source, "kind": r.kind, "waited_s": r.waited_s}), flush=True)
"""


def _logging_runtime(real: Runtime, tmp_path: Path) -> tuple[Path, Path]:
    """An executable that records each call, then runs the real apptainer."""
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "apptainer"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >>{log}\nexec {real.path} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def test_two_processes_build_the_same_image_once(runtime: Runtime, docker_archive: Path, tmp_path: Path) -> None:
    wrapper, log = _logging_runtime(runtime, tmp_path)
    cache = tmp_path / "cache"
    ref = f"docker-archive:{docker_archive}"
    args = [sys.executable, "-c", CHILD, str(PLUGIN_ROOT), ref, str(wrapper), str(cache)]
    procs = [
        subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))

    kinds = sorted(r["kind"] for r in results)
    assert kinds == ["built", "cached"], results
    # The one that did not build waited for the other's lock, then found its SIF.
    waiter = next(r for r in results if r["kind"] == "cached")
    assert waiter["waited_s"] > 0.05, results
    assert results[0]["source"] == results[1]["source"]
    builds = [line for line in log.read_text().splitlines() if " build " in f" {line} "]
    assert len(builds) == 1, builds
    assert os.path.isfile(results[0]["source"])
    leftovers = [p.name for p in cache.iterdir() if not p.name.endswith((".sif", ".lock"))]
    assert leftovers == []
