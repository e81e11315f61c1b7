"""Opt-in: the real Modal service. Collected only when MODAL_TOKEN_ID and
MODAL_TOKEN_SECRET are set (see conftest.py); costs a few sandbox-seconds."""

from __future__ import annotations

import threading
import uuid

import pytest
from hermes_env_modal import ModalEnvironment

pytestmark = [pytest.mark.live]


@pytest.fixture(scope="module")
def live_env():
    with ModalEnvironment(
        mode="direct", task_id=f"hermes-live-{uuid.uuid4().hex[:8]}", app_name="hermes-env-live-test",
        sandbox_timeout=600,
    ) as env:
        yield env


def test_live_echo_state_and_exit_codes(live_env):
    assert live_env.execute("echo hello").output == "hello\n"
    live_env.execute("export HERMES_LIVE=1; cd /tmp")
    r = live_env.execute('echo "$HERMES_LIVE"; pwd; exit 3')
    assert (r.output, r.exit_code) == ("1\n/tmp\n", 3)
    assert live_env.execute("pwd", cwd="/no/such/dir").exit_code == 126


def test_live_timeout_and_cancel_keep_the_sandbox(live_env):
    sid = live_env.sandbox_id
    r = live_env.execute("echo part; sleep 60", timeout=2)
    assert r.exit_code == 124 and r.output == "part\n"
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    assert live_env.execute("sleep 60", cancel=cancel, timeout=90).exit_code == 130
    assert live_env.sandbox_id == sid
    assert live_env.execute("echo alive").output == "alive\n"


def test_live_large_stdin_and_binary_output(live_env):
    assert live_env.execute("wc -c", stdin="x" * 300_000).output.strip() == "300000"
    r = live_env.execute(r"printf 'a\xffb'")
    assert r.output == "a\ufffdb"


def test_live_exit_status_of_a_slow_exiting_command(live_env):
    # The exit status of a real exec is a long-poll; whatever its lag, the code is the command's own.
    for code in (0, 3, 1):
        assert live_env.execute(f"sleep 0.5; exit {code}").exit_code == code
    r = live_env.execute("seq 1 20000 | tail -n 1; exit 7")
    assert (r.output, r.exit_code) == ("20000\n", 7)
