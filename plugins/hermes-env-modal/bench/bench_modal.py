"""Added latency of ``execute('true')`` in direct mode over a raw SDK ``exec('true')``.

One run, one emulator, one sandbox each, samples interleaved so that drift hits
both sides alike. Target: median ratio <= 1.3. Usage::

    python plugins/hermes-env-modal/bench/bench_modal.py [--runs 300]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


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


def _ms(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1e3:6.2f} ms  p90 {sorted(samples)[int(len(samples) * 0.9)] * 1e3:6.2f} ms"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()

    import logging

    logging.getLogger("modal-client").setLevel(logging.ERROR)
    import modal
    import modal.stream_type
    from hermes_env_modal import ModalEnvironment

    emu_mod = _load_emulator()
    with emu_mod.ModalEmulator() as emu, emu_mod.pointed_at(emu):
        app = modal.App.lookup("hermes-env-bench", create_if_missing=True)
        sb = modal.Sandbox.create(app=app, timeout=3600)
        env = ModalEnvironment(mode="direct", task_id="bench")
        try:
            def raw() -> None:
                assert sb.exec("true").wait() == 0

            def raw_bash() -> None:
                p = sb.exec("bash", "-c", "true", text=False)
                p.stdout.read()
                assert p.wait() == 0

            # The very script execute('true') runs (session restore and state
            # capture included), exec'd and streamed by hand: the floor for any
            # backend built on the core's wrapper.
            env.execute("true")
            wrapped = env.session.wrap("true", record_pid=True)
            script = "exec </dev/null 2>&1; " + wrapped.script

            def raw_wrapped() -> None:
                p = sb.exec("bash", "-c", script, text=False, stderr=modal.stream_type.StreamType.DEVNULL)
                for _ in p.stdout:
                    pass
                assert p.wait() == 0

            def ours() -> None:
                assert env.execute("true").exit_code == 0

            cases = {"raw SDK exec('true').wait()": raw,
                     "raw SDK exec('bash','-c','true') + stdout": raw_bash,
                     "raw SDK exec of the wrapped script, streamed": raw_wrapped,
                     "env.execute('true')": ours}
            for fn in cases.values():
                for _ in range(args.warmup):
                    fn()
            samples: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(args.runs):
                for name, fn in cases.items():
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
        finally:
            env.close()
            sb.terminate()

    print(f"modal direct mode vs raw SDK, emulator on 127.0.0.1, {args.runs} interleaved runs each")
    for name, s in samples.items():
        print(f"  {name:44s} {_ms(s)}")
    base = statistics.median(samples["raw SDK exec('true').wait()"])
    ratio = statistics.median(samples["env.execute('true')"]) / base
    ratio_bash = statistics.median(samples["env.execute('true')"]) / statistics.median(
        samples["raw SDK exec('bash','-c','true') + stdout"]
    )
    print(f"  ratio execute / raw exec('true'):             {ratio:.2f}x  (target <= 1.3x)")
    ratio_wrapped = statistics.median(samples["env.execute('true')"]) / statistics.median(
        samples["raw SDK exec of the wrapped script, streamed"]
    )
    print(f"  ratio execute / raw bash -c true + stdout:    {ratio_bash:.2f}x")
    print(f"  ratio execute / raw exec of the same script:  {ratio_wrapped:.2f}x  (this backend's own plumbing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
