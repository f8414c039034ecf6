"""Property tests: every chunk policy delivers each item exactly once beyond its declared overlap."""

from hypothesis import given
from hypothesis import strategies as st

from mstar_core.streaming import FixedChunkPolicy, LeftContextChunkPolicy, SlidingWindowChunkPolicy

tails = st.sampled_from(["flush", "drop"])


def run_stream(policy, n):
    stream = policy.open()
    chunks = []
    for i in range(n):
        chunks.extend(stream.push(i))
    chunks.extend(stream.close())
    return stream, chunks


def check_exactly_once(chunks, n, dropped):
    delivered = [x for c in chunks for x in c.new_items]
    assert delivered == list(range(n - dropped))
    for c in chunks:
        assert list(c.items) == list(range(c.start, c.start + len(c.items)))
        assert 0 <= c.num_context <= len(c.items)


@given(size=st.integers(1, 12), n=st.integers(0, 100), tail=tails)
def test_fixed_chunks_are_consecutive_blocks(size, n, tail):
    stream, chunks = run_stream(FixedChunkPolicy(size, tail=tail), n)
    check_exactly_once(chunks, n, stream.dropped)
    full, rest = divmod(n, size)
    assert [len(c) for c in chunks] == [size] * full + ([rest] if rest and tail == "flush" else [])
    assert stream.dropped == (rest if tail == "drop" else 0)
    assert all(c.num_context == 0 for c in chunks)


@given(window=st.integers(1, 40), stride=st.integers(1, 40), n=st.integers(0, 150), tail=tails)
def test_sliding_window_fires_every_stride_after_window(window, stride, n, tail):
    if stride > window:
        stride = window
    stream, chunks = run_stream(SlidingWindowChunkPolicy(window, stride, tail=tail), n)
    check_exactly_once(chunks, n, stream.dropped)
    regular = [c for c in chunks if not c.final]
    # the reference rule: fire at count == window, window + stride, window + 2*stride, ...
    assert [c.start + len(c) for c in regular] == list(range(window, n + 1, stride))
    assert all(len(c) == window for c in regular)
    for prev, cur in zip(regular, regular[1:], strict=False):
        assert cur.num_context == window - stride
        assert cur.items[: cur.num_context] == prev.items[-cur.num_context :] if cur.num_context else True
    covered = regular[-1].start + window if regular else 0
    if tail == "drop":
        assert stream.dropped == n - covered
    else:
        assert stream.dropped == 0
        if n > covered:
            assert chunks[-1].final and chunks[-1].items[-1] == n - 1
            assert len(chunks[-1]) == min(window, n)


@given(chunk=st.integers(1, 30), left=st.integers(0, 30), n=st.integers(0, 150), tail=tails)
def test_left_context_prefixes_up_to_left_seen_items(chunk, left, n, tail):
    stream, chunks = run_stream(LeftContextChunkPolicy(chunk, left, tail=tail), n)
    check_exactly_once(chunks, n, stream.dropped)
    for c in chunks:
        first_new = c.start + c.num_context
        assert c.num_context == min(left, first_new)
        assert len(c.new_items) == chunk or c.final
    rest = n % chunk
    assert stream.dropped == (rest if tail == "drop" else 0)


def test_orpheus_reference_windows():
    # 28-token windows every 7 tokens; the first at 28, a 40-token stream fires at 28 and 35 only.
    stream, chunks = run_stream(SlidingWindowChunkPolicy(28, 7), 40)
    assert [(c.start, len(c), c.num_context) for c in chunks] == [(0, 28, 0), (7, 28, 21)]
    assert stream.dropped == 5


def test_push_after_close_is_an_error():
    stream = FixedChunkPolicy(2).open()
    stream.close()
    try:
        stream.push(1)
    except RuntimeError as exc:
        assert "after close" in str(exc)
    else:
        raise AssertionError("push after close must raise")


def test_bad_policy_arguments_are_rejected():
    import pytest

    with pytest.raises(ValueError, match="stride"):
        SlidingWindowChunkPolicy(4, 8)
    with pytest.raises(ValueError, match="tail"):
        FixedChunkPolicy(2, tail="keep")
    with pytest.raises(ValueError):
        LeftContextChunkPolicy(0, 1)
