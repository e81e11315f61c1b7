"""Opt-in: the real Modal service. Runs only when MODAL_TOKEN_ID (and
MODAL_TOKEN_SECRET) are set in the environment; costs a few sandbox-seconds."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
from hermes_env_modal import ModalEnvironment

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(
        not os.environ.get("MODAL_TOKEN_ID") or "127.0.0.1" in os.environ.get("MODAL_SERVER_URL", ""),
        reason="live Modal test: set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET to run it",
    ),
]


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
