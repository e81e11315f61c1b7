"""A local environment that is never closed still leaves no state directory behind."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from hermes_env_core.backends.local import LocalEnvironment


def test_state_directory_removed_when_an_unclosed_environment_is_collected() -> None:
    env = LocalEnvironment()
    assert env.execute("export SECRETISH=1").exit_code == 0
    path = env.session.state_dir
    assert os.path.isdir(path)
    del env
    gc.collect()
    assert not os.path.exists(path)


def test_state_directory_removed_at_interpreter_exit() -> None:
    code = (
        "from hermes_env_core.backends.local import LocalEnvironment\n"
        "env = LocalEnvironment(); env.execute('true'); print(env.session.state_dir)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    path = out.stdout.strip()
    assert path and not os.path.exists(path)
