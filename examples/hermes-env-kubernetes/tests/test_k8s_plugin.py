"""The distribution as users install it: found by entry point, the kubernetes client imported only on use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hermes_env_core import create_environment, get_registry
from hermes_env_core.errors import ConfigError


def test_found_by_entry_point_without_importing_the_sdk() -> None:
    code = (
        "import sys\n"
        "from hermes_env_core import get_registry\n"
        "reg = get_registry()\n"
        "spec = reg.resolve('k8s')\n"
        "assert spec.name == 'kubernetes', spec\n"
        "bad = sorted(m for m in sys.modules if m == 'kubernetes' or m.startswith(('kubernetes.', 'websocket')))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_alias_and_summary() -> None:
    spec = get_registry().resolve("kubernetes")
    assert "k8s" in spec.aliases and "pip install 'kubernetes>=33'" == spec.install_hint


def test_unknown_option_rejected_naming_it() -> None:
    with pytest.raises((ConfigError, ValueError), match="no_such_option"):
        create_environment("k8s", no_such_option=1)


def test_template_and_pool_are_exclusive() -> None:
    from hermes_env_kubernetes.config import KubernetesConfig

    with pytest.raises(ValueError, match="not both"):
        KubernetesConfig(sandbox_template="a", sandbox_warm_pool="b")
