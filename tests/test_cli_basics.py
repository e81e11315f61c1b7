"""The CLI's basics, through the installed console script: version, exit statuses, help, options, doctor,
configuration that tolerates the environment, and plugin mistakes reported rather than hidden."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")
WAIT = 60


def clean_env(extra_path: list[Path] | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_")) and k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in extra_path)
    env.update(extra)
    return env


def cli(*args: str, path: list[Path] | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HERMES_ENV, *args],
        capture_output=True,
        text=True,
        env=clean_env(path, **env),
        timeout=WAIT,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def make_dist(tmp_path):
    """Install a distribution for real: a dist-info with entry points, and its modules, in a site directory."""
    site = tmp_path / "site"
    site.mkdir()

    def make(name: str, entry_points: dict[str, str], modules: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
        info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        meta = [f"Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"] + [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("\n".join(meta) + "\n")
        (info / "entry_points.txt").write_text("[hermes_env]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
        for rel, source in modules.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(textwrap.dedent(source))
        return site

    return make


# -- version, exit statuses, help ------------------------------------------------------------


def test_version_names_the_distribution_and_its_version():
    proc = cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"hermes-env {importlib.metadata.version('hermes-env-core')} (hermes-env-core, Python ")


@pytest.mark.parametrize("status", [0, 1, 2, 125, 126, 255])
def test_the_command_status_passes_through(status):
    assert cli("run", f"exit {status}").returncode == status


def test_a_backend_that_cannot_be_reached_exits_125(tmp_path):
    proc = cli("run", "--env", "docker", "-o", "image=debian", "-o", f"docker_host=unix://{tmp_path}/no.sock", "true")
    assert proc.returncode == 125, proc.stderr
    assert proc.stderr.startswith("hermes-env: error: docker:") and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (("run", "--env", "dokcer", "true"), "did you mean 'docker'?"),
        (("run", "-o", "colour=blue", "true"), "unknown option 'colour'"),
        (("run", "-o", "timeout=soon", "true"), "from --option timeout"),
        (("run",), "no command given"),
        (("logs", "nosuchid"), "no background process 'nosuchid'"),
        (("options", "nosuch"), "unknown backend 'nosuch'"),
    ],
)
def test_usage_and_configuration_errors_exit_2_with_one_line(args, needle):
    proc = cli(*args, HERMES_ENV_PROCESSES_FILE=os.path.join(os.getcwd(), "p.json"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hermes-env: error: ") and needle in lines[0], proc.stderr


def test_argument_errors_exit_2():
    assert cli("run", "--timeout", "-3", "true").returncode == 2
    assert cli("no-such-command").returncode == 2


def _subcommands() -> list[str]:
    text = cli("--help").stdout
    block = text.split("commands:", 1)[1]
    names = re.findall(r"^\s{4}(\w[\w-]*)\s", block, re.MULTILINE)
    assert {"run", "shell", "backends", "config", "doctor", "options", "ps", "logs", "kill", "wait"} <= set(names)
    return names


def test_every_subcommand_help_has_a_description():
    for name in _subcommands():
        proc = cli(name, "--help")
        assert proc.returncode == 0, name
        # argparse prints "usage: ...", a blank line, then the description paragraph.
        paragraphs = proc.stdout.split("\n\n")
        assert len(paragraphs) > 2 and not paragraphs[1].lstrip().startswith(("positional", "options")), name
        assert len(paragraphs[1].split()) >= 8, f"{name}: {paragraphs[1]!r}"


# -- options -----------------------------------------------------------------------------------


def test_options_lists_each_option_from_the_model():
    proc = cli("options", "docker", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["options"]}
    from hermes_env_core.backends.docker import DockerConfig

    assert set(rows) == set(DockerConfig.model_fields)
    assert rows["cpu"]["type"] == "float | None" and rows["cpu"]["description"] == "CPU limit in cores."
    assert rows["memory"]["default"] == "4g" and rows["memory"]["type"].startswith("size")
    assert rows["pull"]["type"] == '"missing" | "never" | "always"'
    text = cli("options", "ssh").stdout
    assert "host: str, required" in text and "port: int, default 22" in text and "password" in text


# -- configuration that tolerates the environment ------------------------------------------------


def test_a_terminal_variable_of_another_backend_does_not_break_local():
    proc = cli("run", "echo ok", TERMINAL_IMAGE="python:3.12", TERMINAL_FOO="x")
    assert (proc.returncode, proc.stdout) == (0, "ok\n"), proc.stderr
    config = json.loads(cli("config", "--json", TERMINAL_IMAGE="python:3.12", TERMINAL_TIMOUT="3").stdout)
    ignored = {i["source"]: i["reason"] for i in config["ignored"]}
    assert ignored == {
        "environment variable TERMINAL_IMAGE": "not an option of backend 'local'",
        "environment variable TERMINAL_TIMOUT": "not an option of backend 'local'; did you mean 'timeout'?",
    }
    text = cli("config", TERMINAL_IMAGE="python:3.12").stdout
    assert re.search(r"ignored:\n\s+environment variable TERMINAL_IMAGE\s+not an option of backend 'local'", text)


def test_the_selected_backends_table_and_arguments_stay_strict(tmp_path):
    (tmp_path / "hermes-env.toml").write_text('[terminal.local]\nimage = "x"\n')
    proc = cli("run", "true")
    assert proc.returncode == 2 and "unknown option 'image' for backend 'local'" in proc.stderr


# -- doctor ------------------------------------------------------------------------------------


def test_doctor_with_env_and_options_starts_the_environment_and_reports_json():
    proc = cli("doctor", "--env", "local", "-o", "timeout=5", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    [entry] = report["backends"]
    assert entry["name"] == "local" and entry["ok"] and entry["probe"].startswith("started and ran a command")
    bad = cli("doctor", "--env", "local", "-o", "timeout=soon", "--json")
    assert bad.returncode == 1
    [entry] = json.loads(bad.stdout)["backends"]
    assert not entry["ok"] and "timeout" in entry["problems"][0]


def test_doctor_json_for_an_unreachable_backend(tmp_path):
    proc = cli("doctor", "--env", "docker", "-o", "image=debian", "-o", f"docker_host=unix://{tmp_path}/no.sock", "--json")
    assert proc.returncode == 1
    [entry] = json.loads(proc.stdout)["backends"]
    assert entry["name"] == "docker" and not entry["ok"] and "docker" in entry["problems"][0]


# -- backends tell the truth; plugin mistakes are reported ----------------------------------------

NEEDS_SDK = {
    "hermes_env_needsdk.py": """
        from hermes_env_core import BackendSpec, hookimpl

        @hookimpl
        def hermes_env_backends():
            return [BackendSpec(name="needsdk", target="hermes_env_core.backends.local:LocalEnvironment",
                                requires=("an_sdk_that_is_not_installed_xyz",),
                                install_hint="pip install 'needsdk[sdk]'")]
    """
}

MISSPELT = {
    "hermes_env_misspelt.py": """
        from hermes_env_core import BackendSpec, hookimpl

        @hookimpl
        def hermes_env_backend():
            return [BackendSpec(name="misspelt", target="hermes_env_core.backends.local:LocalEnvironment")]
    """
}

UNMARKED = {
    "hermes_env_unmarked.py": """
        from hermes_env_core import BackendSpec

        def hermes_env_backends():
            return [BackendSpec(name="unmarked", target="hermes_env_core.backends.local:LocalEnvironment")]
    """
}


def test_a_backend_whose_sdk_is_missing_is_not_loadable_with_the_install_line(make_dist):
    site = make_dist("needsdk", {"needsdk": "hermes_env_needsdk"}, NEEDS_SDK)
    rows = {r["name"]: r for r in json.loads(cli("backends", "--json", path=[site]).stdout)["backends"]}
    assert rows["needsdk"]["loadable"] is False
    assert rows["needsdk"]["reason"] == (
        "needs 'an_sdk_that_is_not_installed_xyz', which is not installed: pip install 'needsdk[sdk]'"
    )
    assert rows["local"]["loadable"] is True
    text = cli("backends", path=[site]).stdout
    assert re.search(r"^needsdk .* not loadable: needs 'an_sdk_that_is_not_installed_xyz'", text, re.MULTILINE)


def test_a_distribution_missing_a_requirement_is_not_loadable(make_dist):
    site = make_dist(
        "needsdist", {"needsdist": "hermes_env_needsdk"}, NEEDS_SDK, requires=("no-such-dist-xyz>=1", "pytest")
    )
    rows = {r["name"]: r for r in json.loads(cli("backends", "--json", path=[site]).stdout)["backends"]}
    assert rows["needsdk"]["loadable"] is False and "an_sdk_that_is_not_installed_xyz" in rows["needsdk"]["reason"]


def test_builtins_name_the_sdk_they_import():
    from hermes_env_core.plugins.builtin import hermes_env_backends

    specs = {s.name: s for s in hermes_env_backends()}
    assert specs["docker"].requires == ("docker",) and specs["ssh"].requires == ("paramiko",)
    assert specs["local"].requires == ()


@pytest.mark.parametrize(
    "dist, modules, needle",
    [
        ("misspelt", MISSPELT, "implements hook 'hermes_env_backend', which no hermes-env hookspec declares"),
        ("unmarked", UNMARKED, "defines 'hermes_env_backends' without @hookimpl"),
    ],
)
def test_a_hook_mistake_is_a_load_error_in_backends_and_doctor(make_dist, dist, modules, needle):
    site = make_dist(f"hermes-env-{dist}", {dist: f"hermes_env_{dist}"}, modules)
    listing = cli("backends", "--json", path=[site])
    assert listing.returncode == 0
    [failed] = json.loads(listing.stdout)["failed_plugins"]
    assert failed["plugin"] == dist and failed["distribution"] == f"hermes-env-{dist}"
    assert needle in failed["error"] and "known hooks: hermes_env_backends" in failed["error"]
    text = cli("backends", path=[site]).stdout
    assert f"{dist} (hermes-env-{dist} 1.0): failed: " in text and needle in text
    doctor = cli("doctor", path=[site])
    assert doctor.returncode == 1 and f"plugin {dist} (hermes-env-{dist} 1.0): FAIL: " in doctor.stdout
    assert needle in doctor.stdout
    report = json.loads(cli("doctor", "--json", path=[site]).stdout)
    assert report["ok"] is False and needle in report["failed_plugins"][0]["error"]


def _dependency_closure(name: str) -> list[importlib.metadata.Distribution]:
    """The installed distribution ``name`` and everything it needs without extras."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for req in dist.requires or []:
            if "extra ==" in req.replace('"', "").replace("'", ""):
                continue
            todo.append(re.match(r"[A-Za-z0-9._-]+", req).group(0))
    return list(seen.values())


def test_a_builtin_whose_sdk_extra_is_missing_is_not_loadable(tmp_path):
    # A real interpreter environment with the core and what it needs, but without the docker and ssh extras.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    [site] = (venv / "lib").glob("python3*/site-packages")
    for dist in _dependency_closure("hermes-env-core"):
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists() and top not in ("..", "bin"):
                (site / top).symlink_to(source)
    script = venv / "bin" / "hermes-env"
    lines = Path(HERMES_ENV).read_text().splitlines(keepends=True)
    script.write_text(f"#!{venv / 'bin' / 'python'}\n" + "".join(lines[1:]))
    script.chmod(0o755)
    env = clean_env()
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import docker"], capture_output=True, env=env)
    assert probe.returncode != 0  # the SDK really is absent there
    proc = subprocess.run([str(script), "backends", "--json"], capture_output=True, text=True, env=env, timeout=WAIT)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["backends"]}
    assert rows["local"]["loadable"] is True
    assert rows["docker"]["loadable"] is False
    assert rows["docker"]["reason"] == "needs 'docker', which is not installed: pip install 'hermes-env-core[docker]'"
    assert rows["ssh"]["reason"] == "needs 'paramiko', which is not installed: pip install 'hermes-env-core[ssh]'"
    text = subprocess.run([str(script), "backends"], capture_output=True, text=True, env=env, timeout=WAIT).stdout
    assert re.search(r"^docker .* not loadable: needs 'docker', .*pip install 'hermes-env-core\[docker\]'", text, re.M)
    run = subprocess.run([str(script), "run", "--env", "docker", "-o", "image=x", "true"], capture_output=True,
                         text=True, env=env, timeout=WAIT)
    assert run.returncode == 125 and "pip install 'hermes-env-core[docker]'" in run.stderr
