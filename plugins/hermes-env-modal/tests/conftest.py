"""Fixtures of the hermes-env-modal tests: the gRPC emulator the real modal SDK
talks to, the managed gateway's emulator, and a hard per-test time bound."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TEST_TIMEOUT_S = 150  # hard bound per test: the SDK's retry loops must never hang a run

# The live tests talk to the real Modal service: collected only when real
# credentials are in the environment, so CI never reports them as skipped.
LIVE = bool(os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET")) and (
    "127.0.0.1" not in os.environ.get("MODAL_SERVER_URL", "")
)
collect_ignore = [] if LIVE else ["test_modal_live.py"]
if not os.environ.get("TOOL_GATEWAY_USER_TOKEN"):
    collect_ignore.append("test_modal_live_gateway.py")


def load_emulator():
    """Import tests/emulator under a name of its own: other plugins ship an 'emulator' too."""
    name = "hermes_env_modal_test_emulator"
    if name not in sys.modules:
        pkg_dir = HERE / "emulator"
        spec = importlib.util.spec_from_file_location(
            name, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_gateway_emulator():
    name = "hermes_env_modal_test_gateway"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "gateway_emulator.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(autouse=True)
def _modal_hard_timeout() -> Iterator[None]:
    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded {TEST_TIMEOUT_S}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _check_emulator(emu) -> None:
    assert not emu.errors, emu.errors
    assert not emu.unimplemented, f"SDK called unemulated RPCs: {sorted(emu.unimplemented)}"


@pytest.fixture(scope="module")
def modal_emu():
    """One gRPC emulator per test module, with the SDK pointed at it."""
    mod = load_emulator()
    with mod.ModalEmulator() as emu, mod.pointed_at(emu):
        yield emu
        _check_emulator(emu)


@pytest.fixture(scope="module")
def realistic_modal_emu():
    """An emulator with the real service's latencies on (``emulator.REALISTIC``):
    round trips, a late exit status, output trailing the exit status."""
    mod = load_emulator()
    with mod.ModalEmulator(**mod.REALISTIC) as emu, mod.pointed_at(emu):
        yield emu
        _check_emulator(emu)


@pytest.fixture
def fresh_modal_emu():
    """An emulator of the test's own, for tests that count calls or inject faults."""
    mod = load_emulator()
    with mod.ModalEmulator() as emu, mod.pointed_at(emu):
        yield emu
        _check_emulator(emu)


@pytest.fixture(scope="module")
def gateway():
    """The managed gateway's HTTP emulator, one per test module."""
    mod = load_gateway_emulator()
    with mod.GatewayEmulator() as gw:
        yield gw
        assert not gw.errors, gw.errors


@pytest.fixture(scope="module")
def realistic_gateway():
    """The gateway emulator with a 20 ms round trip on every request."""
    mod = load_gateway_emulator()
    with mod.GatewayEmulator(latency=0.02) as gw:
        yield gw
        assert not gw.errors, gw.errors


@pytest.fixture
def fresh_gateway():
    mod = load_gateway_emulator()
    with mod.GatewayEmulator() as gw:
        yield gw
        assert not gw.errors, gw.errors
