"""The parts on their own: rolling buffer, line matcher, rate limiter, checkpoint, /proc helpers."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_env_core.processes import RateLimit, WatchPattern, procinfo
from hermes_env_core.processes.buffer import OutputBuffer
from hermes_env_core.processes.checkpoint import Checkpoint
from hermes_env_core.processes.watch import LineMatcher, RateLimiter, parse_watch

# -- buffer ---------------------------------------------------------------------------------


def test_buffer_keeps_the_last_limit_bytes_with_absolute_offsets() -> None:
    buf = OutputBuffer(10)
    for piece in (b"0123", b"4567", b"89ab", b"cdef"):
        buf.append(piece)
    assert buf.end == 16 and buf.start == 6
    s = buf.read(0)
    assert s.data == b"6789abcdef" and s.offset == 6 and s.dropped == 6 and s.next_offset == 16
    assert buf.read(12).data == b"cdef"
    assert buf.read(16).data == b"" and buf.read(99).next_offset == 99
    assert buf.read(6, max_bytes=3).data == b"678"


def test_buffer_memory_is_bounded_by_limit_plus_one_chunk() -> None:
    buf = OutputBuffer(1000)
    for _ in range(10000):
        buf.append(b"x" * 300)
    assert buf._held <= 1000 + 300
    assert len(buf.read(0).data) == 1000


def test_buffer_read_never_splits_a_character_while_running() -> None:
    buf = OutputBuffer(100)
    euro = "€".encode()
    buf.append(b"a" + euro[:2])
    s = buf.read(0)
    assert s.data == b"a" and s.next_offset == 1
    buf.append(euro[2:])
    assert buf.read(s.next_offset).text == "€"


def test_buffer_text_after_a_drop_starts_at_a_character() -> None:
    buf = OutputBuffer(4)
    buf.append("€€".encode())  # 6 bytes; the window starts inside the first €
    assert buf.read(0).text == "€"


def test_buffer_wait_wakes_on_output_and_on_close() -> None:
    buf = OutputBuffer(100)
    t = threading.Timer(0.05, buf.append, args=(b"hi",))
    t.start()
    assert buf.wait(0, 10)
    t.join()
    assert not buf.wait(2, 0.01)
    threading.Timer(0.05, buf.close).start()
    assert not buf.wait(2, 10) and buf.closed


def test_buffer_tail_text() -> None:
    buf = OutputBuffer(50)
    buf.append(("x" * 40 + "€" * 10).encode())
    assert buf.tail_text(5) == "€" * 5


# -- line matcher -----------------------------------------------------------------------------


def test_line_split_across_reads_matches_once() -> None:
    m = LineMatcher(parse_watch("server ready"))
    assert m.feed(b"boot\nserver re") == []
    assert m.feed(b"ad") == []
    assert [(str(p), line) for p, line in m.feed(b"y on 80\nready\n")] == [("server ready", "server ready on 80")]
    assert m.flush() == []


def test_multibyte_split_across_reads() -> None:
    m = LineMatcher(parse_watch("prêt"))
    data = "tout est prêt\n".encode()
    i = data.index("ê".encode()) + 1
    assert m.feed(data[:i]) == []
    assert [line for _, line in m.feed(data[i:])] == ["tout est prêt"]


def test_regex_is_matched_per_line_not_across_lines() -> None:
    m = LineMatcher([WatchPattern(r"error\s+\d+", regex=True)])
    assert [line for _, line in m.feed(b"error\n42\nerror 7\n")] == ["error 7"]


def test_anchors_are_per_line_and_crlf_is_stripped() -> None:
    m = LineMatcher(parse_watch(re.compile(r"^READY$")))
    assert [line for _, line in m.feed(b"not READY\r\nREADY\r\nREADY now\r\n")] == ["READY"]


def test_several_patterns_one_report_per_line() -> None:
    m = LineMatcher(parse_watch(["warn", WatchPattern("ERR", ignore_case=True)]))
    hits = m.feed(b"err: x\nwarn: y\nwarn err\nok\n")
    assert [(str(p), line) for p, line in hits] == [("ERR", "err: x"), ("warn", "warn: y"), ("warn", "warn err")]


def test_last_line_without_newline_at_flush() -> None:
    m = LineMatcher(parse_watch("$ "))
    assert m.feed(b"prompt $ ") == []
    assert [line for _, line in m.flush()] == ["prompt $ "]


def test_overlong_line_is_matched_in_pieces() -> None:
    m = LineMatcher(parse_watch("needle"), max_line=1000)
    assert [line[-6:] for _, line in m.feed(b"x" * 5000 + b"needle")] == ["needle"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["ok", "go now", "no", "gone", "é go", "", "x\r", "goé\r"]), max_size=30),
    st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=10),
)
@pytest.mark.parametrize("pattern", ["go", WatchPattern("g[o]", regex=True)], ids=["bytes", "regex"])
def test_any_cut_gives_the_same_matches(pattern: object, lines: list[str], cuts: list[int]) -> None:
    data = "\n".join(lines).encode()
    expected = [ln.removesuffix("\r") for ln in "\n".join(lines).split("\n") if "go" in ln]
    m = LineMatcher(parse_watch(pattern))  # type: ignore[arg-type]
    got: list[str] = []
    pos = 0
    i = 0
    while pos < len(data):
        step = cuts[i % len(cuts)]
        got += [line for _, line in m.feed(data[pos : pos + step])]
        pos += step
        i += 1
    got += [line for _, line in m.flush()]
    assert got == expected


def test_bad_patterns_are_refused() -> None:
    with pytest.raises(ValueError, match="not a valid regex"):
        WatchPattern("(", regex=True)
    with pytest.raises(ValueError):
        WatchPattern("")
    with pytest.raises(TypeError):
        parse_watch([3])  # type: ignore[list-item]


# -- rate limiter -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_default_limit_is_8_per_10s_then_disabled_after_45s_over() -> None:
    clock = Clock()
    lim = RateLimiter(RateLimit(), clock)
    verdicts = []
    # 20 matches a second, for 60 s.
    for i in range(60 * 20):
        clock.now = 1000.0 + i / 20
        v = lim.check()
        verdicts.append((clock.now - 1000.0, v))
        if v == "disable":
            break
    delivered = [t for t, v in verdicts if v == "deliver"]
    t_disable = verdicts[-1][0]
    assert verdicts[-1][1] == "disable"
    assert 45.4 <= t_disable < 45.5  # 45 s after the first suppressed match, the 9th, at 0.4 s
    assert len(delivered) == 8 * 5  # windows 0-10, 10-20, ..., 40-50
    for w in range(5):
        assert sum(1 for t in delivered if w * 10 <= t < (w + 1) * 10) == 8
    assert lim.suppressed == len(verdicts) - len(delivered)


def test_a_quiet_window_resets_the_run_over_the_limit() -> None:
    clock = Clock()
    lim = RateLimiter(RateLimit(max_matches=2, window_s=1.0, disable_after_s=2.5), clock)

    def burst(at: float, n: int) -> list[str]:
        out = []
        for i in range(n):
            clock.now = at + i * 0.01
            out.append(lim.check())
        return out

    assert burst(0.0, 5) == ["deliver", "deliver", "suppress", "suppress", "suppress"]
    assert burst(1.0, 5)[2:] == ["suppress"] * 3
    assert burst(2.0, 1) == ["deliver"]  # at the limit, not over: the run ends with this window
    assert burst(3.0, 5)[2:] == ["suppress"] * 3
    assert burst(4.0, 5)[2:] == ["suppress"] * 3
    assert burst(5.0, 5)[2:] == ["suppress"] * 3
    v = burst(6.0, 5)
    assert v[2] == "disable"  # 3.02 .. 6.02: over for 3 s >= 2.5


def test_skipped_windows_reset_the_run() -> None:
    clock = Clock()
    lim = RateLimiter(RateLimit(max_matches=1, window_s=1.0, disable_after_s=1.5), clock)
    for t in (0.0, 0.1, 2.0, 2.1, 4.0, 4.1):  # over in windows 0, 2, 4: never two in a row
        clock.now = t
        assert lim.check() != "disable"


def test_pending_suppressed_count_goes_with_the_next_delivery() -> None:
    clock = Clock()
    lim = RateLimiter(RateLimit(max_matches=1, window_s=1.0, disable_after_s=100), clock)
    lim.check()
    assert lim.take_pending() == 0
    lim.check()
    lim.check()
    clock.now += 1
    assert lim.check() == "deliver" and lim.take_pending() == 2


# -- checkpoint ------------------------------------------------------------------------------------


def test_checkpoint_merges_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path / "p.json")
    cp.update(owned=(), live=[{"id": "a", "pid": 1}], finished=[], keep_finished=5)
    cp.update(owned=(), live=[{"id": "b", "pid": 2}], finished=[], keep_finished=5)  # another registry
    assert [r["id"] for r in cp.load()["live"]] == ["a", "b"]
    cp.update(owned={"a"}, live=[], finished=[{"id": "a", "ended_at": 5.0}], keep_finished=5)
    data = cp.load()
    assert [r["id"] for r in data["live"]] == ["b"] and [r["id"] for r in data["finished"]] == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "p.json.lock"]
    assert (tmp_path / "p.json").stat().st_mode & 0o777 == 0o600


def test_checkpoint_keeps_the_newest_finished(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path / "p.json")
    fin = [{"id": str(i), "ended_at": 10.0 + i} for i in range(5)]
    cp.update(owned=(), live=[], finished=fin, keep_finished=2)
    assert [r["id"] for r in cp.load()["finished"]] == ["3", "4"]


def test_checkpoint_ignores_a_foreign_file(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text("not json")
    assert Checkpoint(tmp_path / "p.json").load() == {"live": [], "finished": []}


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path / "p.json")

    def write(i: int) -> None:
        cp.update(owned=(), live=[{"id": f"p{i}"}], finished=[], keep_finished=5)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["id"] for r in cp.load()["live"]) == sorted(f"p{i}" for i in range(20))


# -- /proc -------------------------------------------------------------------------------------------


def test_start_time_names_one_process() -> None:
    st = procinfo.proc_stat(os.getpid())
    assert st is not None and st.pid == os.getpid() and st.state in "RS"
    assert procinfo.is_alive(os.getpid(), st.start_time)
    assert not procinfo.is_alive(os.getpid(), st.start_time + 1)
    p = subprocess.Popen(["true"])
    p.wait()
    assert not procinfo.is_alive(p.pid)


def test_comm_with_parentheses_and_spaces(tmp_path: Path) -> None:
    exe = tmp_path / "we ird) (x"
    os.symlink("/bin/sleep", exe)
    p = subprocess.Popen([str(exe), "30"])
    try:
        st = procinfo.proc_stat(p.pid)
        assert st is not None and st.ppid == os.getpid() and st.state in "RS"
    finally:
        p.kill()
        p.wait()
