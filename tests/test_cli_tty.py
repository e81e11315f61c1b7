"""Interactive programs through ``hermes-env shell`` and ``hermes-env run --tty``, used as a person would:
in a tmux pane, keys sent with send-keys, the screen read with capture-pane, on local, docker and ssh."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_env_core.cli.ttylines import INTERACTIVE_PROGRAMS, needs_terminal, simple_commands, state_changes
from tests.support.sshd import in_ci

HERMES_ENV = os.path.join(os.path.dirname(sys.executable), "hermes-env")
WAIT = 60.0
ROWS, COLS = 30, 100


# -- tmux ------------------------------------------------------------------------------------


def _ensure_tmux() -> str:
    path = shutil.which("tmux")
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "tmux"], capture_output=True, timeout=600,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        path = shutil.which("tmux")
    if path is None:
        if in_ci():
            pytest.fail("tmux is required in CI (apt-get install tmux)", pytrace=False)
        pytest.skip("tmux is not installed and could not be installed")
    return path


class Pane:
    """One tmux pane running a command, as a person at a terminal sees it."""

    def __init__(self, tmux: str, sock: Path) -> None:
        self.tmux, self.sock = tmux, sock

    def _t(self, *args: str) -> str:
        r = subprocess.run([self.tmux, "-S", str(self.sock), *args], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def start(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        # After the command: its status and whether the terminal's modes are as before, then the pane stays.
        script = (
            'before=$(stty -g); "$@"; rc=$?; '
            '[ "$(stty -g)" = "$before" ] && m=restored || m=changed; '
            'printf "\\n[exit %s, terminal %s]\\n" "$rc" "$m"; exec sleep 3600'
        )
        env_args = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
        self._t("-f", "/dev/null", "new-session", "-d", "-x", str(COLS), "-y", str(ROWS), "-c", str(cwd), *env_args,
                shlex.join(["bash", "--norc", "--noprofile", "-c", script, "pane", *argv]))
        self._t("set-option", "-g", "status", "off")

    def screen(self) -> str:
        return self._t("capture-pane", "-p", "-J", "-S", "-200")

    def wait_for(self, pattern: str, *, after: int = 0, timeout: float = WAIT) -> re.Match[str]:
        """Wait until the screen matches ``pattern`` past its ``after``-th occurrence; never a fixed sleep."""
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            found = list(rx.finditer(text))
            if len(found) > after:
                return found[after]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} (x{after + 1}) on the screen after {timeout:g}s:\n{text}")
            time.sleep(0.05)

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.screen(), re.M))

    def type(self, text: str) -> None:
        self._t("send-keys", "-l", text)

    def line(self, text: str) -> None:
        self.type(text)
        self._t("send-keys", "Enter")

    def key(self, name: str) -> None:
        self._t("send-keys", name)

    def resize(self, cols: int, rows: int) -> None:
        self._t("resize-window", "-x", str(cols), "-y", str(rows))

    def close(self) -> None:
        subprocess.run([self.tmux, "-S", str(self.sock), "kill-server"], capture_output=True, timeout=30)


# -- backends --------------------------------------------------------------------------------


def _tty_image(client, base: str) -> str:
    """The test image plus this host's python3, top, tput and terminfo (built once, offline)."""
    files: list[Path] = []
    py = Path(os.path.realpath("/usr/bin/python3"))
    lib = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")
    if not str(py).startswith("/usr/bin/") or not lib.is_dir():
        pytest.skip(f"the host's python3 ({py}) is not a system python to copy into the image")
    skip = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "site-packages",
            "dist-packages"}
    for root, dirs, names in os.walk(lib):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith("config-")]
        files += [Path(root, n) for n in names]
    programs = [py, Path(os.path.realpath("/usr/bin/top")), Path(os.path.realpath("/usr/bin/tput"))]
    files += programs
    for prog in programs:
        out = subprocess.run(["ldd", str(prog)], capture_output=True, text=True).stdout
        files += [Path(m) for m in re.findall(r"=> (/\S+)", out)]
    for term_dir in ("/lib/terminfo", "/usr/share/terminfo"):
        for root, _dirs, names in os.walk(term_dir):
            files += [Path(root, n) for n in names]
    files = sorted({f for f in files if f.exists()})
    digest = hashlib.sha256(base.encode())
    for f in files:
        st_ = f.stat()
        digest.update(f"{f}\0{st_.st_size}\0{int(st_.st_mtime)}\n".encode())
    tag = f"hermes-env-tty-test:{digest.hexdigest()[:16]}"
    if client.images.list(name=tag):
        return tag
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", dereference=True) as tar:
        info = tarfile.TarInfo("Dockerfile")
        text = f"FROM {base}\nCOPY root/ /\n".encode()
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
        link = tarfile.TarInfo("root/usr/bin/python3")
        link.type, link.linkname = tarfile.SYMTYPE, py.name
        tar.addfile(link)
        for f in files:
            # The image has this host's layout (/lib -> usr/lib): write through the real directories.
            tar.add(str(f), arcname="root" + os.path.join(os.path.realpath(f.parent), f.name), recursive=False)
    buf.seek(0)
    client.images.build(fileobj=buf, custom_context=True, tag=tag, pull=False, rm=True, network_mode="none")
    return tag


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker),
                        pytest.param("ssh", marks=pytest.mark.ssh)])
def backend(request, tmp_path) -> list[str]:
    """The ``--env ... -o ...`` words that open the backend."""
    if request.param == "local":
        return ["--env", "local"]
    if request.param == "docker":
        from tests.support.docker_engine import ensure_engine, ensure_test_image

        client = ensure_engine()
        image = _tty_image(client, ensure_test_image(client))
        return ["--env", "docker", "-o", f"image={image}", "-o", "network_mode=none"]
    s = request.getfixturevalue("sshd_server")
    return ["--env", "ssh", "-o", f"host={s.host}", "-o", f"port={s.port}", "-o", f"user={s.user}",
            "-o", f"key_path={s.client_key_path}", "-o", "use_agent=false", "-o", "look_for_keys=false",
            "-o", f"known_hosts={tmp_path / 'known_hosts'}"]


@pytest.fixture
def pane(tmp_path):
    tmux = _ensure_tmux()
    panes: list[Pane] = []

    def start(*args: str) -> Pane:
        p = Pane(tmux, tmp_path / f"tmux-{len(panes)}.sock")
        panes.append(p)
        env = {"XDG_STATE_HOME": str(tmp_path / "state"), "INPUTRC": "/dev/null", "HERMES_ENV_HISTFILE": ""}
        p.start([HERMES_ENV, *args], env, tmp_path)
        return p

    yield start
    for p in panes:
        p.close()


PROMPT = r"^\(\w+\) [^\n]*?\$( |$)"  # capture-pane drops the trailing blank
EXIT = r"^\[exit (\d+), terminal (\w+)\]$"


def _prompt(p: Pane, n: int) -> None:
    """Wait for the shell's n-th prompt (counted from 0)."""
    p.wait_for(PROMPT, after=n)


# -- through tmux ----------------------------------------------------------------------------


def test_the_shell_runs_a_python_repl_and_terminal_tools_in_the_session(pane, backend):
    p = pane("shell", *backend)
    _prompt(p, 0)
    # The session's state reaches a program on the terminal: cwd, exported variables, functions.
    p.line('cd /tmp && export HX_TTY=from-session && hx() { echo "fn-$1-$HX_TTY"; }')
    _prompt(p, 1)
    p.line("python3")
    p.wait_for(r"^>>> ", timeout=WAIT)
    p.line("print(6*7)")
    p.wait_for(r"^42$")
    p.line("import os; print(os.environ['HX_TTY'], os.getcwd(), os.isatty(0))")
    p.wait_for(r"^from-session /tmp True$")
    p.line("exit(4)")
    _prompt(p, 2)
    assert re.search(r"\[4\]\$", p.screen())  # the status of the program is the line's
    p.line('echo "status-$?"')  # and the session's
    p.wait_for(r"^status-4$")
    _prompt(p, 3)
    p.line(":tty hx 7")
    p.wait_for(r"^fn-7-from-session$")
    _prompt(p, 4)
    p.line("tput cols; stty size")
    p.wait_for(rf"^{COLS}\n{ROWS} {COLS}$")
    _prompt(p, 5)
    p.line("top -b -n1 | head -3")
    p.wait_for(r"^top - .*load average")
    _prompt(p, 6)
    p.line("exit")
    m = p.wait_for(EXIT)
    assert m.groups() == ("0", "restored")


def test_run_tty_passes_window_size_changes_and_ctrl_c_to_the_program(pane, backend):
    p = pane("run", "--tty", *backend, "python3")
    p.wait_for(r"^>>> ")
    p.line("import os, signal, subprocess; os.get_terminal_size()")
    p.wait_for(rf"^os.terminal_size\(columns={COLS}, lines={ROWS}\)$")
    p.line("signal.signal(signal.SIGWINCH, lambda *a: os.write(1, b'winch %d %d\\r\\n' % os.get_terminal_size()))")
    p.wait_for(r"^>>> ", after=2)
    p.resize(120, 40)
    p.wait_for(r"winch 120 40$")  # the program got SIGWINCH, its terminal has the new size
    p.line("r = subprocess.run(['stty', 'size'])")
    p.wait_for(r"^40 120$")
    # Ctrl-C goes to the program's foreground process group on its terminal: sleep and python get
    # SIGINT, the REPL stays.
    p.line("subprocess.run(['sleep', '100'])")
    p.wait_for(r"^>>> subprocess.run\(\['sleep', '100'\]\)$")
    p.key("C-c")
    p.wait_for(r"^KeyboardInterrupt$")
    p.line("exit(5)")
    m = p.wait_for(EXIT)
    assert m.groups() == ("5", "restored"), p.screen()


def test_ctrl_c_interrupts_sleep_in_the_shell_without_ending_it(pane, backend):
    p = pane("shell", *backend)
    _prompt(p, 0)
    p.line("sleep 100")  # no terminal wanted: runs as the agent's commands do; Ctrl-C cancels it
    p.wait_for(r"\$ sleep 100$")
    p.key("C-c")
    _prompt(p, 1)
    p.line(":tty on")
    p.wait_for(r"^tty: on\n" + PROMPT[1:])
    prompts = p.count(PROMPT)
    p.line("sleep 0 && echo on-a-$(tty | cut -c1-8) && sleep 100")  # on a terminal: Ctrl-C reaches sleep there
    p.wait_for(r"^on-a-/dev/pts$")
    p.key("C-c")
    _prompt(p, prompts)
    assert re.search(r"\[130\]\$", p.screen())
    p.line("echo still-here")
    p.wait_for(r"^still-here$")
    p.line("exit")
    assert p.wait_for(EXIT).group(2) == "restored"


def test_run_tty_returns_the_status_and_restores_the_terminal_after_ctrl_c(pane, backend):
    p = pane("run", "--tty", *backend, "echo started-$HOSTNAME-x; sleep 100")
    p.wait_for(r"^started-.*-x$")
    p.key("C-c")
    m = p.wait_for(EXIT)
    assert m.groups() == ("130", "restored")


def test_sigterm_ends_the_program_and_restores_the_terminal(pane):
    p = pane("run", "--tty", "--env", "local", "echo ready-$$; exec sleep 100")
    m = p.wait_for(r"^ready-(\d+)$")
    sleeper = int(m.group(1))
    shell_pid = int(p._t("display-message", "-p", "#{pane_pid}").strip())
    children = Path(f"/proc/{shell_pid}/task/{shell_pid}/children").read_text().split()
    assert len(children) == 1
    os.kill(int(children[0]), signal.SIGTERM)
    assert p.wait_for(EXIT).groups() == ("143", "restored")
    assert "stopped by SIGTERM" in p.screen()
    deadline = time.monotonic() + WAIT
    while Path(f"/proc/{sleeper}").exists() and Path(f"/proc/{sleeper}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the program outlived hermes-env"
        time.sleep(0.05)


@pytest.mark.docker
def test_run_tty_without_channels_goes_through_the_process_polls(pane):
    from tests.support.docker_engine import ensure_engine, ensure_test_image

    client = ensure_engine()
    image = _tty_image(client, ensure_test_image(client))
    p = pane("run", "--tty", "--env", "docker", "-o", f"image={image}", "-o", "channel=false", "python3")
    p.wait_for(r"^>>> ")
    p.line("print(6*7)")
    p.wait_for(r"^42$")
    p.line("exit(6)")
    assert p.wait_for(EXIT).groups() == ("6", "restored")


def test_run_tty_passes_piped_input_on_and_its_end_as_ctrl_d(backend, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    r = subprocess.run([HERMES_ENV, "run", "--tty", *backend, "python3"], input="import sys\nprint(6*7, sys.stdin.isatty())\n",
                       capture_output=True, text=True, timeout=WAIT, env=env, cwd=tmp_path)
    # The REPL read both lines from its terminal, then Ctrl-D ended it with status 0.
    assert r.returncode == 0, r.stderr
    assert re.search(r"^(>>> )*42 True\r?$", r.stdout, re.M), r.stdout


def test_ctrl_c_typed_right_as_the_prompt_appears_is_never_lost(tmp_path):
    # Python's readline runs the SIGINT handler only when its select() is interrupted: a Ctrl-C landing
    # just before that select() used to wait for the next key (about one in eight here).
    import pty
    import select

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TERMINAL_", "HERMES_ENV_"))}
    env.update(TERM="dumb", INPUTRC="/dev/null", HERMES_ENV_HISTFILE="", XDG_STATE_HOME=str(tmp_path))
    argv = [sys.executable, "-m", "hermes_env_core.cli", "shell", "--env", "local"]
    where = str(tmp_path)
    prompt = re.compile(rb"\(local\) [^\r\n]*\$ $")
    pid, fd = pty.fork()
    if pid == 0:
        try:
            os.chdir(where)
            os.execve(sys.executable, argv, env)
        finally:
            os._exit(127)

    def until_prompt(timeout: float) -> bool:
        buf, deadline = bytearray(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            if prompt.search(buf):
                return True
            if select.select([fd], [], [], 0.02)[0]:
                try:
                    buf += os.read(fd, 65536)
                except OSError:
                    return False
        return False

    try:
        assert until_prompt(WAIT)
        lost = 0
        for _ in range(60):
            os.write(fd, b"true\n")
            assert until_prompt(WAIT)
            os.write(fd, b"\x03")
            if not until_prompt(3):
                lost += 1
                os.write(fd, b"\x03")  # a person presses it again
                assert until_prompt(WAIT)
        assert lost == 0
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)


# -- the line rule ---------------------------------------------------------------------------


def test_which_lines_want_a_terminal():
    assert needs_terminal("python3")
    assert needs_terminal("  FOO=1 sudo -u me vim notes.txt")
    assert needs_terminal("cd /srv && python3.12 -i app.py")
    assert needs_terminal("cat log | less")
    assert needs_terminal("docker exec -it web bash") and not needs_terminal("docker exec web ls")
    assert needs_terminal("timeout 5 top -b -n1 2>/dev/null")
    assert not needs_terminal("echo python3 'vim | less'")
    assert not needs_terminal("cat <<EOF\ntop\nEOF")
    assert not needs_terminal("for p in top vim; do echo $p; done")
    assert not needs_terminal("ls -l", "auto") and needs_terminal("ls -l", "on")
    assert not needs_terminal("cd /tmp", "on") and not needs_terminal("X=1", "on")
    assert not needs_terminal("myfn arg", "on", functions={"myfn"})
    assert not needs_terminal("python3", "off")
    assert state_changes("cd /x && export A=1; B=2; python3") == ["cd", "export", "assignment"]
    with pytest.raises(ValueError, match="tty mode must be one of auto, on, off"):
        needs_terminal("x", "sometimes")


_word = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(prog=st.sampled_from(sorted(INTERACTIVE_PROGRAMS)), args=st.lists(_word, max_size=4),
       quote=st.sampled_from(["plain", "single", "double", "backslash"]))
def test_a_program_is_found_however_it_is_quoted(prog, args, quote):
    word = {"plain": prog, "single": f"'{prog}'", "double": f'"{prog}"',
            "backslash": "".join("\\" + c for c in prog)}[quote]
    line = word + "".join(" " + shlex.quote(a) for a in args)
    cmds = simple_commands(line)
    assert cmds[0].program == prog and list(cmds[0].args) == args
    assert needs_terminal(line)


@settings(max_examples=300, deadline=None)
@given(args=st.lists(_word, min_size=1, max_size=5))
def test_words_in_quotes_are_arguments_never_commands(args):
    line = "echo " + " ".join(shlex.quote(a) for a in args)
    cmds = simple_commands(line)
    assert [(c.program, list(c.args)) for c in cmds] == [("echo", args)]
    assert not needs_terminal(line)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_is_classified_without_error(text):
    needs_terminal(text)
    needs_terminal(text, "on")
    state_changes(text)
