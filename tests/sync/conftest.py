"""Fixtures for the sync engine tests: host trees, a local "remote" and an engine factory."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # `pytest` run without `python -m`: make tests.support importable
    sys.path.insert(0, _ROOT)

import pytest

from hermes_env_core.sync import LocalDirTransport, SyncEngine, SyncMapping
from tests.support.ssh_fixtures import private_sshd_server, sshd_server  # noqa: F401 - fixtures
from tests.sync._helpers import FakeClock, RecordingTransport


@pytest.fixture
def host(tmp_path: Path) -> Path:
    d = tmp_path / "host"
    d.mkdir()
    return d


@pytest.fixture
def remote_base(tmp_path: Path) -> Path:
    d = tmp_path / "remote"
    d.mkdir()
    return d


@pytest.fixture
def transport(remote_base: Path) -> RecordingTransport:
    return RecordingTransport(LocalDirTransport(remote_base))


@pytest.fixture
def remote(remote_base: Path) -> Path:
    """Where the default mapping's remote path lives locally."""
    return remote_base / "work" / "proj"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_engine(host: Path, transport: RecordingTransport, clock: FakeClock, tmp_path: Path):
    delays: list[float] = []

    def make(*mappings: SyncMapping, **kw) -> SyncEngine:
        kw.setdefault("clock", clock)
        kw.setdefault("sleep", delays.append)
        kw.setdefault("lock_dir", str(tmp_path / "locks"))
        return SyncEngine(kw.pop("transport", transport), list(mappings) or [SyncMapping(host, "/work/proj")], **kw)

    make.delays = delays  # type: ignore[attr-defined]
    return make
