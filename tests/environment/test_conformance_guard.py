"""The conformance suite's capability flags and its guard against deleted or overridden tests.

The backend here is real: bash on this machine through ``start_bash``, behind a
target that, like a gateway with a request size limit, refuses a process
whose standard input is over 100 kB with ``UnsupportedOperation``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from hermes_env_core import EnvironmentConfig, ProcessHandle, RunRequest, Target, TargetEnvironment
from hermes_env_core.backends.local import start_bash
from hermes_env_core.errors import UnsupportedOperation
from hermes_env_core.testing import CAPABILITIES, EnvironmentConformance, StdinConformance
from hermes_env_core.testing.guard import suite_tests

LIMIT = 100_000
MANIFEST = Path(__file__).resolve().parents[1] / "support" / "conformance-tests.txt"


class LimitedTarget(Target):
    def __init__(self) -> None:
        self.private = tempfile.mkdtemp(prefix="hermes-t-limited-")

    def start(self, request: RunRequest) -> ProcessHandle:
        if request.stdin is not None and len(request.stdin) > LIMIT:
            raise UnsupportedOperation(f"limited: standard input over {LIMIT} bytes cannot be sent")
        return start_bash(request)

    def state_dir(self) -> str:
        return self.private

    def recover(self, why: str) -> bool:
        return False

    def release(self) -> None:
        shutil.rmtree(self.private, ignore_errors=True)


class LimitedEnvironment(TargetEnvironment[EnvironmentConfig]):
    name = "limited"

    def make_target(self, config: EnvironmentConfig) -> Target:
        return LimitedTarget()


@pytest.fixture
def limited():
    with LimitedEnvironment(timeout=60) as env:
        yield env


class TestLimitedConformance(EnvironmentConformance):
    """The whole suite passes with the two capabilities the target lacks declared."""

    unsupported = {
        "large_stdin": f"requests are limited to {LIMIT} bytes",
        "large_state": f"requests are limited to {LIMIT} bytes; the state travels in one",
    }

    @pytest.fixture
    def environment(self):
        with LimitedEnvironment(timeout=60) as env:
            yield env


def test_an_undeclared_missing_capability_fails(limited):
    class TestUndeclared(StdinConformance):
        pass

    with pytest.raises(UnsupportedOperation, match="over 100000 bytes"):
        TestUndeclared().test_large_stdin(limited)


def test_a_capability_declared_missing_but_present_fails(limited):
    class TestOverDeclared(StdinConformance):
        unsupported = {"stdin": "claimed, but the target has it"}

    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        TestOverDeclared().test_stdin_text(limited)
    # Tests of capabilities it did not declare run unchanged.
    TestOverDeclared().test_no_stdin_means_eof(limited)


def test_declared_missing_capability_passes_only_by_raising(limited):
    class TestDeclared(StdinConformance):
        unsupported = {"large_stdin": "limited requests"}

    assert TestDeclared.test_large_stdin is not StdinConformance.test_large_stdin
    assert TestDeclared.test_large_stdin.hermes_expects_unsupported == "large_stdin"
    TestDeclared().test_large_stdin(limited)  # passes: the target raised UnsupportedOperation


def test_overriding_a_suite_test_without_a_reason_fails_the_class():
    with pytest.raises(TypeError, match="overrides the suite test test_echo without a stated reason"):

        class TestSneaky(EnvironmentConformance):
            def test_echo(self, environment):
                pass


def test_deleting_a_suite_test_fails_the_class():
    with pytest.raises(TypeError, match="deletes the suite test test_large_stdin"):

        class TestDeleting(EnvironmentConformance):
            test_large_stdin = None  # type: ignore[assignment]


def test_override_with_a_stated_reason_is_allowed_and_inherited():
    class TestHonest(EnvironmentConformance):
        overrides = {"test_echo": "this backend's echo is a different builtin"}

        def test_echo(self, environment):
            pass

    class TestChild(TestHonest):
        pass

    assert TestChild.test_echo is TestHonest.test_echo


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"overrides": {"test_echo": ""}}, "overrides\\['test_echo'\\] needs the reason"),
        ({"overrides": {"test_nonexistent": "why"}}, "not a test of the suite"),
        ({"overrides": {"test_echo": "why"}}, "does not override it"),
        ({"unsupported": {"teleport": "why"}}, "'teleport', not a capability"),
        ({"unsupported": {"cancel": " "}}, "unsupported\\['cancel'\\] needs the reason"),
    ],
)
def test_bad_declarations_fail_the_class(body, message):
    with pytest.raises(TypeError, match=message):
        type("TestBad", (EnvironmentConformance,), dict(body))


def test_every_capability_names_existing_suite_tests():
    suite = suite_tests(EnvironmentConformance)
    for cap, (_, tests) in CAPABILITIES.items():
        assert tests and set(tests) <= set(suite), cap


def test_no_suite_test_was_removed():
    # Removing a test from the suite changes the contract for every backend: do it here, on purpose.
    expected = set(MANIFEST.read_text().split())
    missing = expected - set(suite_tests(EnvironmentConformance))
    assert not missing, f"conformance tests removed from the suite: {sorted(missing)} (update {MANIFEST} if meant)"
