"""The installed distribution is found through the ``hermes_env`` entry point, and its plugin module is light."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from singularity_support import PLUGIN_ROOT

HEAVY = (
    "hermes_env_singularity.backend",
    "hermes_env_singularity.config",
    "hermes_env_singularity.images",
    "hermes_env_singularity.instances",
    "hermes_env_singularity.runtime",
)


def _python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter outside the source tree; it prints one JSON line."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd="/", timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


_PROBE = """
    import json, importlib.metadata
    try:
        importlib.metadata.distribution("hermes-env-singularity")
        import hermes_env_singularity
        print(json.dumps({"file": hermes_env_singularity.__file__}))
    except (importlib.metadata.PackageNotFoundError, ImportError) as exc:
        print(json.dumps({"file": None, "error": repr(exc)}))
"""


@pytest.fixture(scope="module")
def installed() -> None:
    """This source tree installed into the current Python (``pip install -e``) if it is not already.

    Probed from a fresh interpreter outside the tree: in this one, the source
    directory (and its egg-info) is on sys.path.
    """
    where = _python(_PROBE)
    if where["file"] is None:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "-e", str(PLUGIN_ROOT)],
            capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, f"pip install -e {PLUGIN_ROOT} failed: {proc.stderr[-2000:]}"
        where = _python(_PROBE)
    assert where["file"] is not None, f"hermes-env-singularity is not importable after pip install -e: {where}"
    assert Path(where["file"]).resolve().is_relative_to(PLUGIN_ROOT), (
        f"hermes_env_singularity is imported from {where['file']}, not from this tree ({PLUGIN_ROOT})"
    )


def test_entry_point_and_registry(installed: None) -> None:
    got = _python("""
        import json
        from importlib.metadata import entry_points
        from hermes_env_core.plugins import get_registry
        eps = {e.name: e.value for e in entry_points(group="hermes_env")}
        reg = get_registry()
        spec = reg.resolve("apptainer")
        print(json.dumps({
            "ep": eps.get("singularity"), "name": spec.name, "aliases": list(spec.aliases),
            "dist": spec.distribution, "target": spec.target,
            "failed": [f.name for f in reg.failed],
        }))
    """)
    assert got["ep"] == "hermes_env_singularity.plugin"
    assert got["name"] == "singularity" and got["aliases"] == ["apptainer"]
    assert got["dist"] == "hermes-env-singularity"
    assert got["target"] == "hermes_env_singularity.backend:SingularityEnvironment"
    assert "singularity" not in got["failed"]


def test_plugin_module_imports_nothing_heavy(installed: None) -> None:
    got = _python(f"""
        import json, sys
        import hermes_env_singularity.plugin
        after_import = [m for m in {HEAVY!r} if m in sys.modules]
        from hermes_env_core.plugins import get_registry
        reg = get_registry()
        reg.names(); reg.resolve("singularity")
        after_listing = [m for m in {HEAVY!r} if m in sys.modules]
        reg.load("singularity")
        after_load = [m for m in {HEAVY!r} if m in sys.modules]
        print(json.dumps([after_import, after_listing, after_load]))
    """)
    assert got[0] == [] and got[1] == [], got
    assert "hermes_env_singularity.backend" in got[2]


def test_created_by_name_through_the_factory(installed: None, sif: Path) -> None:
    got = _python(f"""
        import json
        from hermes_env_core import create_environment
        with create_environment("apptainer", image={str(sif)!r}, cpu=None) as env:
            r = env.execute("cat /marker")
            print(json.dumps({{"cls": type(env).__name__, "name": env.name, "out": r.output}}))
    """)
    assert got == {"cls": "SingularityEnvironment", "name": "singularity", "out": "hermes-test-image\n"}
