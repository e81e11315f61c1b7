"""Modal direct mode on the session server against the raw SDK, in one run.

Against the plugin's gRPC emulator (the real ``modal`` SDK talking to it) with
its latency knobs on: ``execute('true')`` through the session server, one raw
``sandbox.exec('true')`` + ``wait()``, and, for context, a raw exec whose
stdout is read too (what any command with output costs). Samples are
interleaved in rounds of 10 so that drift hits all alike. Two profiles:

- ``realistic``: the emulator's ``REALISTIC`` knobs (20 ms per RPC, the exit
  status 100 ms late, every output byte 250 ms late);
- ``round-trip``: 20 ms per RPC and the exit status 100 ms late, output on time;
- ``none``: no latency added (the plumbing alone, on this machine).

Target: execute / raw exec('true') <= 1.0x.

Usage: python bench/bench_modal_server.py [-n 100] [--only realistic,round-trip,none]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path

from _timing import interleave  # bench/ is the script's own directory

TESTS = Path(__file__).resolve().parents[1] / "plugins" / "hermes-env-modal" / "tests"
PROFILES = {
    "realistic": None,  # the emulator's REALISTIC
    "round-trip": {"rpc_latency": 0.02, "exit_status_delay": 0.1, "output_delay": 0.0},
    "none": {"rpc_latency": 0.0, "exit_status_delay": 0.0, "output_delay": 0.0},
}


def _load_emulator():
    spec = importlib.util.spec_from_file_location(
        "hermes_env_modal_bench_emulator", TESTS / "emulator" / "__init__.py",
        submodule_search_locations=[str(TESTS / "emulator")],
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_profile(emu_mod, knobs: dict[str, float], n: int) -> dict[str, float]:
    import modal
    from hermes_env_modal import ModalEnvironment

    with emu_mod.ModalEmulator(**knobs) as emu, emu_mod.pointed_at(emu):
        app = modal.App.lookup("hermes-env-bench", create_if_missing=True)
        sb = modal.Sandbox.create(app=app, timeout=3600)
        env = ModalEnvironment(mode="direct", task_id=f"bench-{time.time_ns()}")
        try:
            assert env.session_mode == "server"

            def server() -> None:
                assert env.execute("true").exit_code == 0

            def raw() -> None:
                assert sb.exec("true").wait() == 0

            def raw_out() -> None:
                p = sb.exec("true", text=False)
                p.stdout.read()
                assert p.wait() == 0

            return interleave(n, server=server, raw=raw, raw_out=raw_out)
        finally:
            env.close()
            sb.terminate()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--only", default=",".join(PROFILES))
    args = ap.parse_args()
    logging.getLogger("modal-client").setLevel(logging.ERROR)
    emu_mod = _load_emulator()
    print(f"modal direct mode, emulator on 127.0.0.1, {args.n} interleaved samples each (median)")
    for name in args.only.split(","):
        knobs = PROFILES[name] if PROFILES[name] is not None else dict(emu_mod.REALISTIC)
        med = run_profile(emu_mod, knobs, args.n)
        ratio = med["server"] / med["raw"]
        print(
            f"{name:<11} {knobs}\n"
            f"            execute('true') on the server {med['server']:7.1f} ms   "
            f"raw exec('true') + wait {med['raw']:7.1f} ms   raw exec + stdout + wait {med['raw_out']:7.1f} ms\n"
            f"            ratio execute / raw exec {ratio:.2f}x (target <= 1.0x: {'ok' if ratio <= 1.0 else 'MISSED'}); "
            f"execute / raw exec with its output {med['server'] / med['raw_out']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
