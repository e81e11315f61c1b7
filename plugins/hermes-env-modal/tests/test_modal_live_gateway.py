"""Opt-in: the real managed Modal gateway. Collected only when
TOOL_GATEWAY_USER_TOKEN is set (see conftest.py); MODAL_GATEWAY_URL or
TOOL_GATEWAY_DOMAIN pick another gateway than the default."""

from __future__ import annotations

import threading
import uuid

import pytest
from hermes_env_modal import ModalEnvironment

pytestmark = [pytest.mark.live]


@pytest.fixture(scope="module")
def gw_env():
    with ModalEnvironment(
        mode="managed", task_id=f"hermes-live-{uuid.uuid4().hex[:8]}", image="python:3.12-slim", sandbox_timeout=600
    ) as env:
        yield env


def test_live_gateway_state_exit_codes_and_stdin(gw_env):
    assert gw_env.execute("echo hello").output == "hello\n"
    gw_env.execute("export HERMES_LIVE=1; cd /tmp")
    r = gw_env.execute('echo "$HERMES_LIVE"; pwd; exit 3')
    assert (r.output, r.exit_code) == ("1\n/tmp\n", 3)
    assert gw_env.execute("pwd", cwd="/no/such/dir").exit_code == 126
    assert gw_env.execute("wc -c", stdin="x" * 100_000).output.strip() == "100000"
    assert gw_env.execute("od -An -tx1 | tr -d ' \\n'", stdin=b"\xff\x00").output == "ff00"


def test_live_gateway_timeout_and_cancel(gw_env):
    sid = gw_env.sandbox_id
    r = gw_env.execute("echo part; sleep 60", timeout=3)
    assert r.exit_code == 124  # whether "part" is there says whether running polls carry output
    cancel = threading.Event()
    threading.Timer(2.0, cancel.set).start()
    assert gw_env.execute("sleep 60", cancel=cancel, timeout=90).exit_code == 130
    assert gw_env.sandbox_id == sid and gw_env.execute("echo alive").output == "alive\n"


def test_live_gateway_background_child_returns(gw_env):
    r = gw_env.execute("sleep 120 & echo $!")
    assert r.exit_code == 0 and r.output.strip().isdigit()
    gw_env.execute(f"kill {r.output.strip()}")
