"""A process that owns a registry, starts commands, reports them and waits to be killed.

    python owner.py '{"backend": "local", "options": {}, "checkpoint": "...",
                      "commands": [{"command": "...", "detached": true, "watch": "x", "ready": "y"}]}'

Prints one JSON line ``[{"id": ..., "pid": ...}, ...]`` once every command runs,
then blocks reading stdin; the test kills it with SIGKILL to stand for a crash.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    from hermes_env_core.processes import ProcessRegistry

    backend = spec["backend"]
    options = spec.get("options", {})
    if backend == "local":
        from hermes_env_core.backends.local import LocalEnvironment

        env = LocalEnvironment(**options)
    elif backend == "docker":
        from hermes_env_core.backends.docker import DockerEnvironment

        env = DockerEnvironment(**options)
    elif backend == "ssh":
        from hermes_env_core.backends.ssh import SSHEnvironment

        env = SSHEnvironment(**options)
    else:
        raise SystemExit(f"unknown backend {backend!r}")
    reg = ProcessRegistry(checkpoint=spec["checkpoint"])
    started = []
    for c in spec["commands"]:
        p = reg.spawn(env, c["command"], detached=bool(c.get("detached")), watch=c.get("watch"))
        started.append(p)
    for p, c in zip(started, spec["commands"]):
        if c.get("ready"):
            p.wait_for_output(c["ready"], 30)
    print(json.dumps([{"id": p.id, "pid": p.pid} for p in started]), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
