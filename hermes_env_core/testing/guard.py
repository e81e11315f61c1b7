"""Capability flags and the guard that keeps the conformance suite whole.

A backend's test class declares what it does not support in ``unsupported``
(capability -> why): the suite's tests of that capability then pass only if
the operation raises ``UnsupportedOperation``; they are never skipped. A
suite test that a subclass deletes or overrides must be named in
``overrides`` with the reason, or the class fails to build (a collection
error, which fails the run).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from ..errors import UnsupportedOperation

__all__ = ["CAPABILITIES", "check_suite_class", "suite_tests"]

#: capability -> (what it is, the suite tests that exercise it)
CAPABILITIES: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "stdin": (
        "execute(stdin=...) feeds the command's standard input",
        (
            "test_stdin_text", "test_stdin_without_final_newline_exact", "test_stdin_bytes",
            "test_stdin_looking_like_delimiters", "test_arbitrary_stdin_round_trips",
        ),
    ),
    "large_stdin": ("stdin of a few hundred kilobytes", ("test_large_stdin",)),
    "large_state": ("session state larger than one argv string (128 KiB)", ("test_large_state_round_trips",)),
    "cancel": ("a cancel event set from another thread stops the command", ("test_cancel_from_another_thread",)),
    "background": (
        "a command may leave background processes running and return at once",
        ("test_background_child_returns_promptly", "test_setsid_disown_returns_promptly",
         "test_server_with_redirected_output"),
    ),
}

_PACKAGE = __name__.rpartition(".")[0]  # hermes_env_core.testing


def _is_suite(klass: type) -> bool:
    return klass.__module__ == _PACKAGE or klass.__module__.startswith(_PACKAGE + ".")


def suite_tests(cls: type) -> dict[str, Callable[..., Any]]:
    """The suite's own tests that ``cls`` inherits: name -> the suite's function."""
    tests: dict[str, Callable[..., Any]] = {}
    for klass in reversed([k for k in cls.__mro__ if _is_suite(k)]):
        for name, value in vars(klass).items():
            if name.startswith("test_") and callable(value):
                tests[name] = value
    return tests


def _expect_unsupported(test: Callable[..., Any], capability: str, reason: str) -> Callable[..., Any]:
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        with pytest.raises(UnsupportedOperation):
            test(*args, **kwargs)

    run.hermes_expects_unsupported = capability  # type: ignore[attr-defined]
    run.__doc__ = f"Declared unsupported ({capability}: {reason}): must raise UnsupportedOperation."
    return run


def check_suite_class(cls: type) -> None:
    """Called for every subclass of the suite outside this package: checks and applies its declarations."""
    if _is_suite(cls):
        return
    suite = suite_tests(cls)
    unsupported: Mapping[str, str] = getattr(cls, "unsupported", {})
    overrides: Mapping[str, str] = getattr(cls, "overrides", {})
    problems: list[str] = []
    for cap, why in unsupported.items():
        if cap not in CAPABILITIES:
            problems.append(f"unsupported names {cap!r}, not a capability (known: {', '.join(CAPABILITIES)})")
        elif not isinstance(why, str) or not why.strip():
            problems.append(f"unsupported[{cap!r}] needs the reason as a non-empty string")
    for name, why in overrides.items():
        if name not in suite:
            problems.append(f"overrides names {name!r}, which is not a test of the suite")
        elif not isinstance(why, str) or not why.strip():
            problems.append(f"overrides[{name!r}] needs the reason as a non-empty string")
    for name, original in suite.items():
        current = getattr(cls, name, None)
        if current is original or getattr(current, "__wrapped__", None) is original:
            if name in overrides:
                problems.append(f"overrides names {name!r}, but {cls.__qualname__} does not override it")
            continue
        if name not in overrides:
            what = "deletes" if not callable(current) else "overrides"
            problems.append(
                f"{what} the suite test {name} without a stated reason; "
                f"add overrides = {{{name!r}: 'why'}} to the class, or keep the suite's test"
            )
    if problems:
        raise TypeError(f"conformance class {cls.__qualname__}: " + "; ".join(problems))
    for cap, why in unsupported.items():
        for name in CAPABILITIES[cap][1]:
            test = suite.get(name)
            if test is not None and name not in overrides and getattr(cls, name) is test:
                setattr(cls, name, _expect_unsupported(test, cap, why))
