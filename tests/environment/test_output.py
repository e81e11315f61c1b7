"""Frame splitting and bounded capture, independent of any backend."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_env_core.environment.output import FrameSplitter, OutputCapture, _partial_suffix

MARK = b"\x1eabc123:"


def frame(rc: int, cwd: bytes, state: bytes) -> bytes:
    return MARK + b"S%d %d %d 0\x1f" % (rc, len(cwd), len(state)) + cwd + state + MARK + b"E\n"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks, last = [], 0
    for p in points + [len(data)]:
        chunks.append(data[last:p])
        last = p
    return chunks


@settings(max_examples=300)
@given(st.binary(max_size=300), st.binary(max_size=200), st.binary(max_size=50), st.lists(st.integers(0, 10**6), max_size=12))
def test_any_chunking_gives_same_output_and_frame(before, state, after, cuts):
    data = before + frame(5, b"/w d", state) + after
    out = bytearray()
    sp = FrameSplitter(MARK, out.extend)
    for chunk in split(data, cuts):
        sp.feed(chunk)
    sp.flush()
    if MARK in before:
        return  # the command forged our nonce: not reachable, the nonce is secret
    assert bytes(out) == before + after
    assert sp.frame == (5, "/w d", state.decode("utf-8", "surrogateescape"))
    assert not sp.corrupt


def test_interleaved_frame_detected():
    data = frame(0, b"/", b"declare -- A=1\n")
    bad = data[:30] + b"GET / 200\n" + data[30:]
    out = bytearray()
    sp = FrameSplitter(MARK, out.extend)
    sp.feed(bad)
    sp.flush()
    assert sp.frame is None and sp.corrupt


def test_no_frame_flushes_held_back_prefix():
    out = bytearray()
    sp = FrameSplitter(MARK, out.extend)
    sp.feed(b"abc\x1eabc")
    sp.flush()
    assert bytes(out) == b"abc\x1eabc" and sp.frame is None


@given(st.binary(max_size=40))
def test_partial_suffix_is_a_marker_prefix(data):
    n = _partial_suffix(data, MARK)
    assert n < len(MARK)
    if n:
        assert MARK.startswith(data[-n:])


@settings(max_examples=200)
@given(st.lists(st.binary(max_size=3000), max_size=30), st.integers(2048, 8192))
def test_capture_keeps_head_and_tail(chunks, limit):
    cap = OutputCapture(limit)
    for c in chunks:
        cap.feed(c)
    res = cap.finish()
    data = b"".join(chunks)
    if len(data) <= limit:
        assert res.text == data.decode("utf-8", "replace") and not res.truncated
    else:
        assert res.truncated
        assert res.dropped_bytes >= len(data) - limit
        assert res.dropped_bytes <= len(data) - limit + 8  # up to 3 bytes trimmed at each cut
        assert f"{res.dropped_bytes} bytes omitted" in res.text


@given(st.text(max_size=2000), st.lists(st.integers(0, 10**5), max_size=10))
def test_live_callback_decodes_split_characters(text, cuts):
    got = []
    cap = OutputCapture(1 << 20, on_output=got.append)
    data = text.encode()
    for chunk in split(data, cuts):
        cap.feed(chunk)
    cap.finish()
    assert "".join(got) == text


def test_oversized_frame_is_dropped_not_leaked(monkeypatch):
    import hermes_env_core.environment.output as out_mod

    monkeypatch.setattr(out_mod, "_MAX_FRAME_BYTES", 100)
    out = bytearray()
    sp = FrameSplitter(MARK, out.extend)
    sp.feed(b"visible\n" + MARK + b"S0 1 5000 0\x1f/" + b"declare -- X=1\n" * 20)
    sp.flush()
    assert bytes(out) == b"visible\n" and sp.corrupt and sp.frame is None
