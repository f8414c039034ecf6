"""Sealed sessions: only the two ends of a session can speak in it; forgeries, replays and reflections are refused."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_core.wire import AuthError, Heartbeat, decode, encode
from mstar_core.wire.auth import HelloVerifier, _hello_mac, make_hello, verify_welcome
from mstar_core.wire.session import FULL_MAC_BYTES, MAGIC, Channel, new_session_id, session_of

SECRET = b"correct horse battery staple"


def pair():
    hello = make_hello(SECRET, "w0")
    session = new_session_id()
    return Channel.for_worker(SECRET, hello.nonce, session), Channel.for_coordinator(SECRET, hello.nonce, session)


def test_sealed_messages_open_on_the_other_end_in_both_directions():
    worker, coordinator = pair()
    beat = encode(Heartbeat(worker="w0", seq=1, time=1.0))
    assert decode(coordinator.open(worker.seal(beat))) == decode(beat)
    assert decode(worker.open(coordinator.seal(beat))) == decode(beat)
    assert session_of(worker.seal(beat)) == worker.session == coordinator.session


def test_forged_altered_replayed_and_reflected_messages_are_refused():
    worker, coordinator = pair()
    sealed = worker.seal(encode(Heartbeat(worker="w0", seq=1, time=1.0)))
    coordinator.open(sealed)
    with pytest.raises(AuthError, match="replayed"):
        coordinator.open(sealed)
    altered = worker.seal(encode(Heartbeat(worker="w0", seq=2, time=1.0)))
    altered[1] = altered[1].replace(b'"seq":2', b'"seq":3')
    with pytest.raises(AuthError, match="authentication failed"):
        coordinator.open(altered)
    with pytest.raises(AuthError, match="authentication failed"):  # our own message sent back to us
        worker.open(worker.seal([b"{}"]))
    other_hello = make_hello(SECRET, "w0")  # same secret, another session: its keys open nothing of ours
    stranger = Channel.for_worker(SECRET, other_hello.nonce, new_session_id())
    forged = stranger.seal([b"{}"])
    forged[0] = forged[0][: len(MAGIC)] + coordinator.session + forged[0][len(MAGIC) + 8:]
    with pytest.raises(AuthError, match="authentication failed"):
        coordinator.open(forged)
    with pytest.raises(AuthError, match="not sealed for this session"):
        coordinator.open(stranger.seal([b"{}"]))


def test_big_frames_are_bound_by_length_and_small_ones_by_content():
    worker, coordinator = pair()
    big = bytes(FULL_MAC_BYTES)
    sealed = worker.seal([b"{}", big, b"small"])
    assert coordinator.open(list(sealed))[1] == big
    cut = worker.seal([b"{}", big])
    cut[2] = big[:-1]
    with pytest.raises(AuthError):
        coordinator.open(cut)
    swapped = worker.seal([b"{}", b"small"])
    swapped[2] = b"smalL"
    with pytest.raises(AuthError):
        coordinator.open(swapped)


def test_gaps_in_sequence_numbers_are_accepted():  # a ROUTER may drop at its high-water mark
    worker, coordinator = pair()
    worker.seal([b"lost"])
    assert coordinator.open(worker.seal([b"kept"])) == [b"kept"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=48), max_size=4), st.binary(min_size=36, max_size=36))
def test_junk_is_refused_with_auth_error_only(frames, head):
    _, coordinator = pair()
    for candidate in (frames, [MAGIC + coordinator.session + head[12:], *frames], [head, *frames]):
        if session_of(candidate) is None:
            continue
        with pytest.raises(AuthError):
            coordinator.open(candidate)


junk_text = st.text(max_size=40) | st.sampled_from(["é" * 64, "\u0000", "ff" * 31 + "é", "\U0001f600" * 32])


@settings(max_examples=300, deadline=None)
@given(mac=junk_text, worker=junk_text, host=junk_text, nonce=junk_text,
       timestamp=st.floats() | st.integers(-(2**63), 2**63), pid=st.integers(-(2**63), 2**63))
def test_any_hello_fields_are_refused_with_auth_error_only(mac, worker, host, nonce, timestamp, pid):
    verifier = HelloVerifier(SECRET)
    hello = attrs.evolve(make_hello(b"not the secret at all", "w0"), mac=mac, worker=worker, host=host,
                         nonce=nonce, timestamp=float(timestamp), pid=pid)
    with pytest.raises(AuthError):
        verifier.verify(hello)


def test_a_non_ascii_mac_is_a_refusal_not_a_crash():
    with pytest.raises(AuthError, match="wrong shared secret"):
        HelloVerifier(SECRET).verify(attrs.evolve(make_hello(SECRET, "w0"), mac="é" * 64))
    hello = make_hello(SECRET, "w0")
    welcome = HelloVerifier(SECRET).welcome(hello, session=new_session_id(), heartbeat_interval=0.2)
    with pytest.raises(AuthError):
        verify_welcome(SECRET, hello, attrs.evolve(welcome, mac="ü" * 64))


def test_a_signed_hello_with_a_non_finite_timestamp_is_stale():
    hello = attrs.evolve(make_hello(SECRET, "w0"), timestamp=math.nan)
    hello = attrs.evolve(hello, mac=_hello_mac(SECRET, hello))
    with pytest.raises(AuthError, match="stale"):
        HelloVerifier(SECRET).verify(hello)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=400, deadline=None)
@given(tag=st.sampled_from(["hello", "invoke_node", "node_result", "loop_done", "heartbeat", "x"]) | st.text(max_size=6),
       fields=st.dictionaries(st.sampled_from(["worker", "mac", "pid", "inputs", "outputs", "request_id", "node",
                                               "call_index", "error", "error_status", "load", "seq"]), json_values,
                              max_size=6),
       tensors=st.lists(st.dictionaries(st.sampled_from(["dtype", "shape", "strides", "nbytes", "device"]),
                                        json_values | st.lists(st.integers(0, 2**64), max_size=4), max_size=5),
                        max_size=2),
       extra=st.lists(st.binary(max_size=16), max_size=2))
def test_decoding_any_header_raises_wire_error_only(tag, fields, tensors, extra):
    import orjson

    from mstar_core.wire import WireError

    try:
        header = orjson.dumps({"type": tag, "fields": fields, "tensors": tensors}, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return  # an int beyond 64 bits: orjson will not even write it
    try:
        decode([header, *extra])
    except WireError:
        pass
