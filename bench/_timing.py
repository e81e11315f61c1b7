"""Timing helpers shared by the benchmarks: interleaved rounds, medians in milliseconds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds taken by each of ``n`` calls of ``fn``."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def interleave(n: int, **series: Callable[[], object]) -> dict[str, float]:
    """Medians (ms) of each series, run in rounds of 10 so drift hits all alike (3 warm-up calls each)."""
    got: dict[str, list[float]] = {k: [] for k in series}
    for fn in series.values():
        for _ in range(3):
            fn()
    for _ in range(max(n // 10, 1)):
        for k, fn in series.items():
            got[k] += timed(fn, 10)
    return {k: statistics.median(v) * 1000 for k, v in got.items()}
