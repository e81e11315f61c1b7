"""Plugins found through installed entry points, each check in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A plugin whose backend imports an "SDK": listing must not import either.
SDK_PLUGIN = {
    "hermes_env_fakesdk/__init__.py": "",
    "hermes_env_fakesdk/plugin.py": """
        from hermes_env_core.plugins import BackendSpec, hookimpl

        @hookimpl
        def hermes_env_backends():
            return [BackendSpec(name="fakesdk", target="hermes_env_fakesdk.backend:FakeEnvironment",
                                config_model="hermes_env_fakesdk.backend:FakeConfig",
                                install_hint="pip install fake-sdk-for-tests")]
    """,
    "hermes_env_fakesdk/backend.py": """
        import fake_sdk_for_tests  # the heavy SDK
        from hermes_env_core.backends.local import LocalConfig, LocalEnvironment

        class FakeConfig(LocalConfig):
            pass

        class FakeEnvironment(LocalEnvironment):
            name = "fakesdk"
            config_model = FakeConfig
    """,
    "fake_sdk_for_tests.py": "LOADED = True\n",
}

HEAVY = (
    "hermes_env_example.backend",
    "hermes_env_fakesdk.backend",
    "fake_sdk_for_tests",
    "hermes_env_core.backends.",
    "docker",
    "paramiko",
    "modal",
    "daytona",
)

LIST_AND_REPORT = """
    import json, sys
    from hermes_env_core.plugins import get_registry

    registry = get_registry()
    listing = {{n: [s.distribution, list(s.aliases), s.summary] for n, s in registry.backends.items()}}
    plugins = [[p.name, p.distribution, p.version, p.error] for p in registry.plugins]
    heavy = sorted(m for m in sys.modules if m.startswith({heavy!r}))
    print(json.dumps({{"listing": listing, "plugins": plugins, "heavy": heavy}}))
"""


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_installed_example_is_found_by_name_and_runs(example_site, run_py, subprocess_env):
    out = last_json(
        run_py(
            """
        import json
        from hermes_env_core import create_environment, get_registry

        registry = get_registry()
        info = registry.provider("example")
        with create_environment("example-local") as env:
            result = env.execute("pwd; echo $((6 * 7))")
            kind = type(env).__module__ + "." + type(env).__name__
            root = env.root
        print(json.dumps({"names": registry.names(), "dist": info.distribution, "version": info.version,
                          "value": info.value, "kind": kind, "output": result.output, "root": root}))
    """,
            [example_site],
        )
    )
    assert "example" in out["names"] and "local" in out["names"]
    assert (out["dist"], out["version"], out["value"]) == ("hermes-env-example", "0.1.0", "hermes_env_example.plugin")
    assert out["kind"] == "hermes_env_example.backend.ExampleEnvironment"
    assert out["output"] == f"{out['root']}\n42\n"
    assert (
        str(example_site)
        in subprocess.run(
            [sys.executable, "-c", "import hermes_env_example; print(hermes_env_example.__file__)"],
            capture_output=True,
            text=True,
            env=subprocess_env([example_site]),
        ).stdout
    ), "the example must come from the pip-installed copy, not the source tree"


def test_without_the_example_installed_it_is_not_found(run_py):
    out = last_json(run_py(LIST_AND_REPORT.format(heavy=HEAVY)))
    assert "example" not in out["listing"]
    assert set(out["listing"]) >= {"local", "docker", "ssh"}


def test_listing_backends_imports_no_backend_module_and_no_sdk(example_site, make_dist, run_py):
    site = make_dist("hermes-env-fakesdk", {"fakesdk": "hermes_env_fakesdk.plugin"}, SDK_PLUGIN)
    out = last_json(run_py(LIST_AND_REPORT.format(heavy=HEAVY), [example_site, site]))
    assert {"example", "fakesdk", "local", "docker", "ssh"} <= set(out["listing"])
    assert out["listing"]["fakesdk"][0] == "hermes-env-fakesdk"
    assert out["heavy"] == []
    # The same check sees the imports once a backend is created, so it can fail.
    created = last_json(
        run_py(
            """
        import json, sys
        from hermes_env_core import create_environment
        with create_environment("fakesdk") as env:
            env.execute("true")
        print(json.dumps(sorted(m for m in sys.modules if m.startswith(("hermes_env_fakesdk.backend", "fake_sdk")))))
    """,
            [site],
        )
    )
    assert created == ["fake_sdk_for_tests", "hermes_env_fakesdk.backend"]


def test_the_backends_command_imports_no_backend_module_either(example_site, make_dist, run_py):
    site = make_dist("hermes-env-fakesdk", {"fakesdk": "hermes_env_fakesdk.plugin"}, SDK_PLUGIN)
    proc = run_py(
        f"""
        import json, sys, contextlib, io
        from hermes_env_core.cli import main
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(["backends"])
        heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}))
        print(json.dumps({{"code": code, "text": buf.getvalue(), "heavy": heavy}}))
    """,
        [example_site, site],
    )
    out = last_json(proc)
    assert out["code"] == 0 and out["heavy"] == []
    assert "fakesdk" in out["text"] and "hermes-env-example" in out["text"]


def test_missing_sdk_is_an_error_only_when_that_backend_is_created(make_dist, run_py):
    modules = {k: v for k, v in SDK_PLUGIN.items() if k != "fake_sdk_for_tests.py"}
    site = make_dist("hermes-env-fakesdk", {"fakesdk": "hermes_env_fakesdk.plugin"}, modules)
    out = last_json(
        run_py(
            """
        import json
        from hermes_env_core import PluginLoadError, create_environment, get_registry
        names = get_registry().names()
        try:
            create_environment("fakesdk")
        except PluginLoadError as exc:
            error = str(exc)
        with create_environment("local") as env:
            ok = env.execute("echo fine").output
        print(json.dumps({"names": names, "error": error, "ok": ok}))
    """,
            [site],
        )
    )
    assert "fakesdk" in out["names"] and out["ok"] == "fine\n"
    assert "fake_sdk_for_tests" in out["error"] and "pip install fake-sdk-for-tests" in out["error"]


BROKEN = {
    "hermes_env_broken.py": """
        raise RuntimeError("boom: this plugin is broken on purpose")
    """
}


def test_a_broken_plugin_warns_is_listed_failed_and_does_not_stop_others(make_dist, run_py):
    site = make_dist("hermes-env-broken", {"broken": "hermes_env_broken"}, BROKEN, version="0.3")
    out = last_json(
        run_py(
            """
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from hermes_env_core import PluginLoadError, PluginLoadWarning, create_environment, get_registry
            registry = get_registry()
        failed = [[p.name, p.distribution, p.version, p.error] for p in registry.failed]
        warned = [str(w.message) for w in caught if issubclass(w.category, PluginLoadWarning)]
        with create_environment("local") as env:
            ok = env.execute("echo still works").output
        try:
            create_environment("broken")
        except PluginLoadError as exc:
            asked = str(exc)
        print(json.dumps({"failed": failed, "warned": warned, "ok": ok, "asked": asked}))
    """,
            [site],
        )
    )
    [[name, dist, version, error]] = out["failed"]
    assert (name, dist, version) == ("broken", "hermes-env-broken", "0.3")
    assert "RuntimeError: boom: this plugin is broken on purpose" in error and "hermes_env_broken.py" in error
    assert len(out["warned"]) == 1 and "broken" in out["warned"][0] and "boom" in out["warned"][0]
    assert out["ok"] == "still works\n"
    assert "failed to load" in out["asked"] and "boom" in out["asked"]


@pytest.mark.parametrize("how", ["env", "argument"])
def test_strict_mode_makes_a_broken_plugin_fatal(make_dist, run_py, how):
    site = make_dist("hermes-env-broken", {"broken": "hermes_env_broken"}, BROKEN)
    code = """
        import json
        from hermes_env_core import PluginLoadError, get_registry
        try:
            get_registry(strict={strict})
            print(json.dumps("no error"))
        except PluginLoadError as exc:
            print(json.dumps(str(exc)))
    """
    if how == "env":
        proc = run_py(code.format(strict=None), [site], HERMES_ENV_STRICT_PLUGINS="1")
    else:
        proc = run_py(code.format(strict=True), [site])
    message = last_json(proc)
    assert "broken" in message and "boom" in message and "hermes-env-broken" in message


def test_a_broken_plugin_in_the_cli(make_dist, subprocess_env):
    site = make_dist("hermes-env-broken", {"broken": "hermes_env_broken"}, BROKEN)
    env = subprocess_env([site])
    listing = subprocess.run(
        [sys.executable, "-m", "hermes_env_core.cli", "backends"], capture_output=True, text=True, env=env, timeout=60
    )
    assert listing.returncode == 0, listing.stderr
    assert "broken (hermes-env-broken" in listing.stdout and "failed: RuntimeError: boom" in listing.stdout
    assert "local" in listing.stdout
    run = subprocess.run(
        [sys.executable, "-m", "hermes_env_core.cli", "run", "--env", "broken", "true"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 125  # a broken install: a failure of hermes-env, not of the invocation
    assert "Traceback" not in run.stderr and "boom" in run.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "hermes_env_core.cli", "run", "echo fine"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (ok.returncode, ok.stdout) == (0, "fine\n")
    assert "warning" in ok.stderr and "broken" in ok.stderr and "Traceback" not in ok.stderr


def _provider(module: str, names: str) -> dict[str, str]:
    return {
        f"{module}.py": f"""
        from hermes_env_core.plugins import BackendSpec, hookimpl

        @hookimpl
        def hermes_env_backends():
            return [{names}]
    """
    }


def test_a_name_provided_twice_is_an_error_naming_both_distributions(make_dist, run_py):
    make_dist(
        "hermes-env-alpha",
        {"alpha": "hermes_env_alpha"},
        _provider("hermes_env_alpha", 'BackendSpec(name="dup", target="x.y:Z")'),
    )
    site = make_dist(
        "hermes-env-beta",
        {"beta": "hermes_env_beta"},
        _provider("hermes_env_beta", 'BackendSpec(name="beta", target="x.y:Z", aliases=("dup",))'),
    )
    out = last_json(
        run_py(
            """
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from hermes_env_core import DuplicateBackendError, get_registry
            registry = get_registry()
        try:
            registry.resolve("dup")
        except DuplicateBackendError as exc:
            error = str(exc)
        print(json.dumps({"error": error, "warned": [str(w.message) for w in caught],
                          "local": registry.resolve("local").name}))
    """,
            [site],
        )
    )
    assert "hermes-env-alpha" in out["error"] and "hermes-env-beta" in out["error"] and "'dup'" in out["error"]
    assert any("hermes-env-alpha" in w and "hermes-env-beta" in w for w in out["warned"])
    assert out["local"] == "local"
    strict = run_py(
        """
        from hermes_env_core import get_registry
        get_registry(strict=True)
    """,
        [site],
    )
    assert strict.returncode != 0 and "DuplicateBackendError" in strict.stderr


def test_a_plugin_claiming_a_builtin_name_names_the_core_too(make_dist, run_py):
    site = make_dist(
        "hermes-env-squatter",
        {"squat": "hermes_env_squat"},
        _provider("hermes_env_squat", 'BackendSpec(name="local", target="x.y:Z")'),
    )
    proc = run_py(
        """
        from hermes_env_core import create_environment
        create_environment("local")
    """,
        [site],
    )
    assert proc.returncode != 0
    assert "DuplicateBackendError" in proc.stderr
    assert "hermes-env-core" in proc.stderr and "hermes-env-squatter" in proc.stderr


def test_a_plugin_returning_something_else_is_listed_failed(make_dist, run_py):
    site = make_dist("hermes-env-odd", {"odd": "hermes_env_odd"}, _provider("hermes_env_odd", '"docker"'))
    out = last_json(
        run_py(
            """
        import json, warnings
        warnings.simplefilter("ignore")
        from hermes_env_core import get_registry
        print(json.dumps([[p.name, p.error] for p in get_registry().failed]))
    """,
            [site],
        )
    )
    assert out == [["odd", "hermes_env_backends() returned 'docker', not a BackendSpec"]]


def test_the_core_registers_its_backends_through_its_own_entry_point(run_py):
    out = last_json(
        run_py("""
        import json
        import importlib.metadata as importlib_metadata
        from hermes_env_core import get_registry
        eps = [[ep.name, ep.value, ep.dist.name] for ep in importlib_metadata.entry_points(group="hermes_env")]
        core = get_registry().plugins[0]
        print(json.dumps({"eps": eps, "core": [core.name, core.value, core.distribution, list(core.backends)]}))
    """)
    )
    assert ["core", "hermes_env_core.plugins.builtin", "hermes-env-core"] in out["eps"]
    assert out["core"] == ["core", "hermes_env_core.plugins.builtin", "hermes-env-core", ["local", "docker", "ssh"]]


def test_the_example_passes_its_own_conformance_suite(example_site, example_dir, subprocess_env, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(example_dir),
            str(example_dir / "tests"),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env([example_site]),
        timeout=900,
        cwd=tmp_path,
    )
    tail = "\n".join(proc.stdout.splitlines()[-15:])
    assert proc.returncode == 0, f"{tail}\n{proc.stderr[-2000:]}"
    assert " passed" in tail
