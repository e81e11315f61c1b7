"""What only the Docker backend has, against a real engine: hardening, limits,
recreation, reuse across processes, the orphan reaper and its errors.

The conformance suite runs in test_docker_conformance.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
from pydantic import ValidationError

from hermes_env_core.backends.docker import (
    DEFAULT_CAPABILITIES,
    DockerConfig,
    DockerEnvironment,
    reap_orphans,
)
from hermes_env_core.errors import BackendError, EnvironmentUnavailable
from hermes_env_core.testing import wait_until

pytestmark = pytest.mark.docker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Linux capability numbers (linux/capability.h), for reading CapEff.
_CAP_BITS = {
    "CHOWN": 0, "DAC_OVERRIDE": 1, "DAC_READ_SEARCH": 2, "FOWNER": 3, "FSETID": 4, "KILL": 5,
    "SETGID": 6, "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_RAW": 13,
    "SYS_CHROOT": 18, "SYS_PTRACE": 19, "SYS_ADMIN": 21, "MKNOD": 27, "AUDIT_WRITE": 29, "SETFCAP": 31,
}


def _mask(caps) -> int:
    return sum(1 << _CAP_BITS[c] for c in caps)


def _task() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def _cgroup(env: DockerEnvironment, v1: str, v2: str) -> str:
    """A cgroup file of the container, on cgroup v1 or v2."""
    return env.execute(f"cat /sys/fs/cgroup/{v1} 2>/dev/null || cat /sys/fs/cgroup/{v2}").output.strip()


def _run_py(code: str, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False, **kw,
    )


def _exists(client, ref: str) -> bool:
    import docker

    try:
        client.containers.get(ref)
        return True
    except docker.errors.NotFound:
        return False


def _by_task(client, task: str) -> list:
    return client.containers.list(all=True, filters={"label": f"hermes-env.task-id={task}"})


@pytest.fixture
def make_env(docker_image):
    """Factory for environments on the test image; all closed (and removed) afterwards."""
    made: list[DockerEnvironment] = []

    def make(**options) -> DockerEnvironment:
        options.setdefault("pull", "never")
        options.setdefault("timeout", 60)
        env = DockerEnvironment(image=options.pop("image", docker_image), **options)
        made.append(env)
        return env

    yield make
    for env in made:
        try:
            env.close()
            env.cleanup(force=True)
        except EnvironmentUnavailable:
            pass


# -- configuration --------------------------------------------------------------------
def test_image_is_required_and_named():
    with pytest.raises(ValidationError, match="'image' option is required"):
        DockerConfig()


def test_unknown_option_and_bad_values_rejected(tmp_path):
    with pytest.raises(ValidationError, match="no_such_option"):
        DockerConfig(image="x", no_such_option=1)
    with pytest.raises(ValidationError, match="unknown capability 'FLY'"):
        DockerConfig(image="x", cap_add=("FLY",))
    with pytest.raises(ValidationError, match="not a memory size"):
        DockerConfig(image="x", memory="lots")
    with pytest.raises(ValidationError, match="existing absolute host directory"):
        DockerConfig(image="x", workspace="bind", workspace_source=str(tmp_path / "missing"))
    assert DockerConfig(image="x", cap_add=("cap_net_raw",)).cap_add == ("NET_RAW",)


def test_module_imports_without_the_sdk_and_says_what_to_install():
    r = _run_py(
        """
        import sys
        sys.modules["docker"] = None  # as if not installed
        from hermes_env_core.backends import docker as backend
        try:
            backend.DockerEnvironment(image="x")
        except backend.EnvironmentUnavailable as exc:
            print(exc)
        print(backend.DockerEnvironment.check_requirements())
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("pip install 'hermes-env-core[docker]'") == 2, r.stdout


def test_module_import_does_not_import_the_sdk():
    r = _run_py("import sys, hermes_env_core.backends.docker; print('docker' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# -- errors ---------------------------------------------------------------------------
def test_unreachable_engine_names_the_host(docker_image, monkeypatch):
    with pytest.raises(EnvironmentUnavailable, match=r"unix:///nonexistent/docker\.sock \(from the docker_host option\)"):
        DockerEnvironment(image=docker_image, docker_host="unix:///nonexistent/docker.sock")
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")
    with pytest.raises(EnvironmentUnavailable, match=r"tcp://127\.0\.0\.1:9 \(from DOCKER_HOST\)"):
        DockerEnvironment(image=docker_image)
    problems = DockerEnvironment.check_requirements()
    assert len(problems) == 1 and "tcp://127.0.0.1:9 (from DOCKER_HOST)" in problems[0]


def test_check_requirements_passes_with_an_engine(docker_client):
    assert DockerEnvironment.check_requirements() == []


def test_missing_image_is_named(docker_client):
    image = f"hermes-env-no-such-image:{uuid.uuid4().hex[:8]}"
    with pytest.raises(EnvironmentUnavailable, match=rf"image '{image}' not found.*docker pull {image}"):
        DockerEnvironment(image=image, pull="never")
    # No registry is reachable here, so pulling fails too; the error says which image.
    with pytest.raises(EnvironmentUnavailable, match=rf"image '{image}' is not on .* pulling it failed"):
        DockerEnvironment(image=image, pull="missing")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"network_mode": "container:no-such-container"}, "no-such-container"),  # start fails
        ({"user": "nosuchuser"}, "nosuchuser"),  # the user check after start fails
        ({"user": "nosuchuser", "workspace": "bind", "workspace_source": "/tmp"}, "nosuchuser"),
    ],
)
def test_failed_create_leaves_no_container(docker_client, docker_image, options, message):
    task = _task()
    with pytest.raises(EnvironmentUnavailable, match=message):
        DockerEnvironment(image=docker_image, pull="never", task_id=task, **options)
    assert _by_task(docker_client, task) == []


# -- hardening, seen from inside --------------------------------------------------------
def test_default_hardening_seen_from_inside(make_env, docker_client):
    env = make_env()
    status = env.execute("grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status").output
    fields = dict(line.split(":\t") for line in status.splitlines())
    assert int(fields["CapEff"], 16) == _mask(DEFAULT_CAPABILITIES)
    assert int(fields["CapBnd"], 16) == _mask(DEFAULT_CAPABILITIES)
    assert fields["NoNewPrivs"] == "1"
    assert _cgroup(env, "pids/pids.max", "pids.max") == "512"
    assert _cgroup(env, "memory/memory.limit_in_bytes", "memory.max") == str(4 << 30)
    mounts = {ln.split()[1]: ln.split() for ln in env.execute("cat /proc/mounts").output.splitlines()}
    for path, size in (("/tmp", 512 << 10), ("/var/tmp", 256 << 10), ("/run", 64 << 10)):
        assert mounts[path][2] == "tmpfs", path
        opts = mounts[path][3].split(",")
        assert f"size={size}k" in opts and "nosuid" in opts and "noexec" not in opts, (path, opts)
    # The network is "none": only the loopback interface exists.
    devs = [ln.split(":")[0].strip() for ln in env.execute("tail -n +3 /proc/net/dev").output.splitlines()]
    assert devs == ["lo"]
    # PID 1 is docker-init, which reaps zombies.
    assert env.execute("cat /proc/1/comm").output == "docker-init\n"
    info = docker_client.api.inspect_container(env.container_id)
    assert info["HostConfig"]["CapDrop"] == ["ALL"]
    assert info["HostConfig"]["NetworkMode"] == "none"


def test_options_change_the_limits(make_env):
    env = make_env(
        read_only_root=True, tmpfs={"/tmp": "16m"}, tmpfs_noexec=True, cap_add=("CHOWN",),
        pids_limit=64, memory="128m", cpu=0.5, no_new_privileges=False,
    )
    r = env.execute("touch /probe")
    assert r.exit_code != 0 and "Read-only file system" in r.output
    assert env.execute("touch /tmp/ok && touch /workspace/ok && echo writable").output == "writable\n"
    opts = next(ln.split()[3] for ln in env.execute("cat /proc/mounts").output.splitlines() if ln.split()[1] == "/tmp")
    assert "size=16384k" in opts.split(",") and "noexec" in opts.split(",")
    status = env.execute("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status").output
    assert f"CapEff:\t{_mask(['CHOWN']):016x}" in status and "NoNewPrivs:\t0" in status
    assert _cgroup(env, "pids/pids.max", "pids.max") == "64"
    assert _cgroup(env, "memory/memory.limit_in_bytes", "memory.max") == str(128 << 20)
    quota = _cgroup(env, "cpu/cpu.cfs_quota_us", "cpu.max").split()[0]
    assert quota == "50000"


def test_non_root_user_gets_a_writable_workspace(make_env):
    env = make_env(user="agent")
    r = env.execute("id -u; pwd; touch x && echo ok")
    assert r.output == "1000\n/workspace\nok\n"


def test_pids_limit_enforced_and_a_fork_bomb_is_cleaned_up(make_env):
    env = make_env(pids_limit=32)
    assert _cgroup(env, "pids/pids.max", "pids.max") == "32"
    # What runs while nothing else does (a resident channel adds its server and relay).
    idle = int(_cgroup(env, "pids/pids.current", "pids.current"))
    r = env.execute("f() { f & f & wait; }; f", timeout=3)
    assert r.timed_out and r.exit_code == 124
    assert "fork" in r.output  # bash was refused new processes
    assert r.duration_s < 3 + env.config.kill_grace_s + 3

    def current() -> int:
        return int(_cgroup(env, "pids/pids.current", "pids.current"))

    assert wait_until(lambda: current() <= max(idle, 6), 20), f"{current()} processes left, {idle} when idle"
    assert env.execute("echo usable").output == "usable\n"


def test_oom_killed_command_is_137_with_a_note(make_env):
    env = make_env(memory="64m")
    # tail keeps the one endless line in memory: it is the process killed.
    r = env.execute("head -c 300m /dev/zero | tail >/dev/null")
    assert r.exit_code == 137
    assert any("memory limit (64m) was hit" in n for n in r.notes), r.notes
    # bash itself killed: no state report, still 137 and the note.
    r = env.execute('x=$(head -c 300m /dev/zero | tr "\\0" a); echo survived')
    assert r.exit_code == 137 and "survived" not in r.output
    assert any("memory limit" in n for n in r.notes), r.notes
    r = env.execute("echo fine")
    assert r.output == "fine\n" and not any("memory" in n for n in r.notes)


def test_kill_exit_137_without_oom_has_no_memory_note(make_env):
    r = make_env().execute("sleep 30 & kill -9 $!; wait $!")
    assert r.exit_code == 137 and not any("memory" in n for n in r.notes)


# -- commands -----------------------------------------------------------------------------
def test_timeout_kills_the_tree_inside_the_container(make_env):
    env = make_env()
    r = env.execute("sleep 4242 & (sleep 4243 &) ; sleep 4244", timeout=1)
    assert r.timed_out

    def leftovers() -> str:
        return "".join(ln for ln in env.execute("ps -eo stat=,args=").output.splitlines(True) if "sleep 424" in ln)

    assert wait_until(lambda: leftovers() == "", 10), leftovers()


def test_env_values_never_on_a_command_line(make_env, docker_client):
    secret = "s3cr3t-" + uuid.uuid4().hex
    env = make_env(env={"HERMES_T_SECRET": secret})
    r = env.execute('echo "$HERMES_T_SECRET"; for f in /proc/[0-9]*/cmdline; do tr "\\0" " " <"$f"; echo; done')
    first, rest = r.output.split("\n", 1)
    assert first == secret
    assert "bash" in rest and secret not in rest
    # A later command (its script restores state) still keeps it off the command line.
    env.execute("cd /tmp")
    r = env.execute('for f in /proc/[0-9]*/cmdline; do tr "\\0" " " <"$f"; echo; done')
    assert "bash" in r.output and secret not in r.output
    assert secret not in json.dumps(docker_client.api.inspect_container(env.container_id))


def test_scripts_beyond_the_argv_limit(make_env):
    env = make_env()
    # Not exported: one environment string over 128 KiB would break every exec.
    env.execute("HERMES_T_BIG=$(head -c 200000 /dev/zero | tr '\\0' x)")
    assert env.execute("echo ${#HERMES_T_BIG}").output == "200000\n"  # script through stdin
    r = env.execute('cat; echo "${#HERMES_T_BIG} $#"', stdin="from stdin\n")  # script through a file
    assert r.output == "from stdin\n200000 0\n"
    assert env.execute("ls -a /tmp | grep -c '[.]script$'").output == "0\n"


# -- the container's life -------------------------------------------------------------------
def test_recreated_after_docker_kill_with_state(make_env, docker_client):
    env = make_env()
    env.execute("export HERMES_T_KEEP=42; keep() { echo kept; }; cd /var/tmp")
    cid = env.container_id
    docker_client.api.kill(cid)
    assert wait_until(lambda: not docker_client.api.inspect_container(cid)["State"]["Running"], 10)
    r = env.execute('echo "$HERMES_T_KEEP"; keep; pwd')
    assert r.output == "42\nkept\n/var/tmp\n"
    assert any(n.startswith("environment recreated:") for n in r.notes), r.notes
    assert env.container_id == cid  # started again: files on its disk kept
    assert not env.execute("true").notes


def test_recreated_after_removal_with_state(make_env, docker_client):
    env = make_env()
    env.execute("export HERMES_T_KEEP=43; echo x >/workspace/old")
    old = env.container_id
    docker_client.api.remove_container(old, force=True, v=True)
    r = env.execute('echo "$HERMES_T_KEEP"; ls /workspace')
    assert r.output == "43\n"
    assert any(n.startswith("environment recreated:") and "removed" in n for n in r.notes), r.notes
    assert env.container_id != old and _exists(docker_client, env.container_id)


def test_container_killed_during_a_command_raises_then_recovers(make_env, docker_client):
    env = make_env()
    started = threading.Event()
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(env.execute("echo ready; sleep 60", on_output=lambda t: started.set()))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    docker_client.api.kill(env.container_id)
    t.join(30)
    assert outcome and isinstance(outcome[0], BackendError), outcome
    r = env.execute("echo back")
    assert r.output == "back\n" and any("environment recreated" in n for n in r.notes)


def test_non_persistent_removed_on_close(make_env, docker_client):
    env = make_env()
    cid = env.container_id
    env.close()
    assert not _exists(docker_client, cid)


def test_persistent_reused_across_processes(docker_client, docker_image):
    task = _task()
    code = """
        import sys
        from hermes_env_core.backends.docker import DockerEnvironment
        env = DockerEnvironment(image=sys.argv[1], pull="never", task_id=sys.argv[2], persistent=True)
        env.execute("echo written-by-first >/workspace/mark")
        print(env.container_id)
        env.close()  # persistent: left running
    """
    first = _run_py(code, docker_image, task)
    assert first.returncode == 0, first.stderr
    cid = first.stdout.strip()
    assert docker_client.api.inspect_container(cid)["State"]["Running"]
    env = DockerEnvironment(image=docker_image, pull="never", task_id=task, persistent=True)
    try:
        r = env.execute("cat /workspace/mark")
        assert env.container_id == cid
        assert r.output == "written-by-first\n"
        assert any("reusing persistent container" in n for n in r.notes), r.notes
        env.close()
        assert _exists(docker_client, cid)  # close() leaves a persistent container
    finally:
        env.cleanup(force=True)
    assert not _exists(docker_client, cid)


def test_bind_mounted_workspace(make_env, tmp_path):
    env = make_env(workspace="bind", workspace_source=str(tmp_path))
    assert env.execute("pwd; echo from-container >f").output == "/workspace\n"
    assert (tmp_path / "f").read_text() == "from-container\n"
    ro = make_env(workspace="bind", workspace_source=str(tmp_path), workspace_read_only=True)
    r = ro.execute("cat f; echo x >g")
    assert "from-container" in r.output and r.exit_code != 0 and not (tmp_path / "g").exists()


def test_named_volume_workspace_outlives_the_container(make_env, docker_client):
    volume = f"hermes-t-{uuid.uuid4().hex[:8]}"
    try:
        env = make_env(workspace="volume", workspace_source=volume)
        env.execute("echo kept >/workspace/f")
        env.close()
        assert make_env(workspace="volume", workspace_source=volume).execute("cat f").output == "kept\n"
    finally:
        # The volume outlives its containers; remove those first (make_env's teardown is later).
        for c in docker_client.containers.list(all=True, filters={"volume": volume}):
            c.remove(force=True)
        docker_client.volumes.get(volume).remove()


# -- the reaper ---------------------------------------------------------------------------
_ORPHAN = """
    import os, sys
    from hermes_env_core.backends.docker import DockerEnvironment
    env = DockerEnvironment(image=sys.argv[1], pull="never", task_id=sys.argv[2],
                            persistent=sys.argv[3] == "1", idle_lifetime_s=float(sys.argv[4]))
    env.execute("true")
    print(env.container_id, flush=True)
    os._exit(0)  # dies without cleanup: the container is an orphan
"""


def _orphan(image: str, *, persistent: bool = False, idle: float = 3600.0) -> str:
    r = _run_py(_ORPHAN, image, _task(), "1" if persistent else "0", str(idle))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_reaper_removes_orphans_and_keeps_the_rest(docker_client, docker_image, make_env):
    gone_owner = _orphan(docker_image)
    fresh_persistent = _orphan(docker_image, persistent=True)
    idle_persistent = _orphan(docker_image, persistent=True, idle=0.001)
    exited_persistent = _orphan(docker_image, persistent=True)
    docker_client.api.kill(exited_persistent)
    mine = make_env().container_id
    try:
        reap_orphans()
        assert not _exists(docker_client, gone_owner)
        assert not _exists(docker_client, exited_persistent)
        assert _exists(docker_client, fresh_persistent)  # recently used, lifetime 1 h
        assert _exists(docker_client, mine)  # its owner is alive
        # last use has one-second resolution: it is idle once that second is over
        assert wait_until(lambda: (reap_orphans(), not _exists(docker_client, idle_persistent))[1], 5)
    finally:
        for cid in (fresh_persistent, idle_persistent, exited_persistent, gone_owner):
            if _exists(docker_client, cid):
                docker_client.api.remove_container(cid, force=True, v=True)


def test_reaper_runs_when_a_process_creates_its_first_environment(docker_client, docker_image):
    orphan = _orphan(docker_image)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys
            from hermes_env_core.backends.docker import DockerEnvironment
            with DockerEnvironment(image=sys.argv[1], pull="never"):
                print("ready", flush=True)
                sys.stdin.read()  # until the test is done
        """), docker_image],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert wait_until(lambda: not _exists(docker_client, orphan), 15)
    finally:
        child.communicate("", timeout=60)
        if _exists(docker_client, orphan):
            docker_client.api.remove_container(orphan, force=True)


# -- another user in the container (issue 11) ---------------------------------------------
def _as_other_user(env: DockerEnvironment, script: str) -> tuple[int, str]:
    code, out = env._exec_simple(["bash", "-c", script], user="4242:4242")
    return code, out.decode(errors="replace")


def test_other_user_cannot_read_secrets_from_command_lines(make_env):
    secret = "s3cr3t-" + uuid.uuid4().hex
    env = make_env(env={"HERMES_T_CFG": secret})
    env.execute(f"export HERMES_T_EXP={secret}-exported; HERMES_T_PLAIN={secret}-plain")
    started = threading.Event()
    stop = threading.Event()
    done: list[object] = []
    t = threading.Thread(
        target=lambda: done.append(
            env.execute("echo running; sleep 60.21", cancel=stop, on_output=lambda s: started.set() if "running" in s else None)
        )
    )
    t.start()
    try:
        assert started.wait(30)
        code, dump = _as_other_user(env, 'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " <"$f"; echo; done')
    finally:
        stop.set()
        t.join(60)
    assert code == 0 and "sleep 60.21" in dump  # it saw root's running command
    assert secret not in dump


def test_other_user_cannot_enter_or_plant_state(make_env):
    env = make_env()
    env.execute("alias hermes_t_mine='echo mine'; HERMES_T_V=root")
    d = env.session.state_dir
    assert env.execute(f"stat -c '%a %U' {d}").output == "700 root\n"
    code, out = _as_other_user(
        env,
        f"ls {d} 2>&1; echo 'hermes_t_evil() {{ echo pwned; }}' >{d}/.hermes-x-0.state 2>&1; "
        # The old, predictable paths: a FIFO and a symlink where root used to write its state.
        f"mkfifo /tmp/.hermes-{env.task_id}-0.state; ln -s /etc/shadow /tmp/.hermes-{env.task_id}-1.state; "
        f"ls -d /tmp/hermes-env-* /dev/shm/hermes-env-* 2>/dev/null; echo done",
    )
    assert out.count("Permission denied") >= 2 and "done" in out, out
    r = env.execute("hermes_t_mine; echo $HERMES_T_V; type hermes_t_evil 2>&1 | head -1", timeout=20)
    assert not r.timed_out
    assert r.output.startswith("mine\nroot\n") and "pwned" not in r.output
    # Root's next commands write nothing through the planted paths.
    _, leaked = _as_other_user(env, f"cat /tmp/.hermes-{env.task_id}-1.state 2>&1 | head -c 200; echo")
    assert "declare" not in leaked
