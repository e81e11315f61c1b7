"""``run --background``, ``ps``, ``logs`` and ``kill``, each call a separate process, as from a shell."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hermes_env_core.backends.local import LocalEnvironment
from hermes_env_core.processes import cli, procinfo
from hermes_env_core.testing import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_cli(tmp_path: Path):
    env = dict(os.environ, HERMES_ENV_PROCESSES_FILE=str(tmp_path / "processes.json"))
    env.pop("TERMINAL_ENV", None)

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hermes_env_core.processes.cli", *args],
            capture_output=True, text=True, env=env, cwd=str(REPO), timeout=60, input=stdin, check=False,
        )

    return run


def test_background_ps_logs_kill_across_invocations(run_cli, marker: str) -> None:
    r = run_cli("run", "--background", "--watch", "tick 2", f"for i in 1 2 3; do echo tick $i; done; sleep 300 # {marker}")
    assert r.returncode == 0, r.stderr
    pid_id, _, pid = r.stdout.split()
    assert pid_id.startswith("bg-") and procinfo.is_alive(int(pid))
    assert wait_until(lambda: "tick 3" in run_cli("logs", pid_id).stdout, 15)

    rows = json.loads(run_cli("ps", "--json").stdout)
    assert [(row["id"], row["status"], row["pid"]) for row in rows] == [(pid_id, "running", int(pid))]

    r = run_cli("kill", pid_id)
    assert r.returncode == 0 and "killed" in r.stdout, r.stderr
    assert wait_until(lambda: not procinfo.is_alive(int(pid)), 10)
    rows = json.loads(run_cli("ps", "--all", "--json").stdout)
    assert [(row["id"], row["status"], row["exit_code"]) for row in rows] == [(pid_id, "killed", 143)]
    assert run_cli("logs", pid_id).stdout == "tick 1\ntick 2\ntick 3\n"  # still on disk
    r = run_cli("kill", pid_id)
    assert r.returncode == 1 and "not running" in r.stderr


def test_logs_follow_until_exit(run_cli, tmp_path: Path) -> None:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    r = run_cli("run", "--background", f"echo one; read _ <{fifo}; echo two")
    pid_id = r.stdout.split()[0]
    follow = subprocess.Popen(
        [sys.executable, "-m", "hermes_env_core.processes.cli", "logs", "--follow", pid_id],
        stdout=subprocess.PIPE, text=True, cwd=str(REPO),
        env=dict(os.environ, HERMES_ENV_PROCESSES_FILE=str(tmp_path / "processes.json")),
    )
    try:
        assert follow.stdout is not None
        assert follow.stdout.readline() == "one\n"
        with open(fifo, "w") as f:  # now the process may end
            f.write("\n")
        assert follow.stdout.read() == "two\n"
        assert follow.wait(30) == 0
    finally:
        follow.kill()
        follow.wait()


def test_ps_reports_a_process_whose_pid_was_reused(run_cli, tmp_path: Path) -> None:
    r = run_cli("run", "--background", "echo up; sleep 300")
    pid_id, _, pid = r.stdout.split()
    path = tmp_path / "processes.json"
    data = json.loads(path.read_text())
    data["live"][0]["start_time"] += 1
    path.write_text(json.dumps(data))
    rows = json.loads(run_cli("ps", "--all", "--json").stdout)
    assert [(row["id"], row["status"]) for row in rows] == [(pid_id, "lost")]
    assert procinfo.is_alive(int(pid))  # not ours any more: left alone
    os.kill(int(pid), 9)


def test_unknown_id_is_an_error(run_cli) -> None:
    r = run_cli("logs", "bg-nope")
    assert r.returncode == 2 and "no background process 'bg-nope'" in r.stderr


def test_subcommands_plug_into_another_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """What the main CLI calls: add_subcommands / add_run_arguments / run_background."""
    monkeypatch.setenv("HERMES_ENV_PROCESSES_FILE", str(tmp_path / "p.json"))
    opened: list[LocalEnvironment] = []

    @contextlib.contextmanager
    def opener(args: argparse.Namespace):
        env = LocalEnvironment()
        opened.append(env)
        try:
            yield env
        finally:
            env.close()

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    run = sub.add_parser("run")
    cli.add_run_arguments(run)
    run.add_argument("command")
    cli.add_subcommands(sub, environment=opener)
    args = parser.parse_args(["run", "--background", "--watch", "x", "echo x; sleep 300"])
    assert args.background and args.watch == ["x"]
    with opener(args) as env:
        assert cli.run_background(args, env, args.command) == 0
    pid_id = capsys.readouterr().out.split()[0]
    args = parser.parse_args(["kill", pid_id])
    assert args.func(args) == 0
    assert "killed" in capsys.readouterr().out
    assert all(e.closed for e in opened)


def test_ps_shows_a_pty_process_waiting_for_input(run_cli, marker: str) -> None:
    r = run_cli("run", "--background", "--pty", f"read -p 'proceed? ' a # {marker}")
    assert r.returncode == 0, r.stderr
    pid_id, _, pid = r.stdout.split()

    def waiting() -> bool:
        rows = json.loads(run_cli("ps", "--json").stdout)
        return [(row["id"], row["waiting_for_input"]) for row in rows] == [(pid_id, True)]

    assert wait_until(waiting, 30, interval=0.5)
    assert "waiting-input" in run_cli("ps").stdout
    assert run_cli("kill", pid_id).returncode == 0
    assert wait_until(lambda: not procinfo.is_alive(int(pid)), 10)


def test_ps_does_not_call_a_silent_sleep_waiting(run_cli, marker: str) -> None:
    r = run_cli("run", "--background", "--pty", f"sleep 300 # {marker}")
    pid_id, _, pid = r.stdout.split()
    # Silent for longer than the 2 s a prompt needs to count as waiting.
    assert wait_until(lambda: time.time() - json.loads(run_cli("ps", "--json").stdout)[0]["started_at"] > 3, 30)
    rows = json.loads(run_cli("ps", "--json").stdout)
    assert [(row["id"], row["status"], row["waiting_for_input"]) for row in rows] == [(pid_id, "running", False)]
    assert run_cli("kill", pid_id).returncode == 0
