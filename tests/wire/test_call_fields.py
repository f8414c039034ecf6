"""The fields a call carries across the worker boundary besides its values: arrival, and an error's status and param."""

from mstar_core.cluster.remote_values import error_fields
from mstar_core.cluster.worker_link import remote_failure
from mstar_core.errors import RequestError
from mstar_core.wire import InvokeNode, LoopDone, NodeResult, RunLoop, decode, encode
from mstar_core.wire.messages import RunConsumer


def roundtrip(msg):
    return decode(encode(msg))


def test_arrival_travels_on_calls_and_loops_and_defaults_to_zero():
    call = InvokeNode(request_id="r", node="m/n", call_index=0, inputs={}, arrival=12345.678901234)
    assert roundtrip(call).arrival == 12345.678901234
    loop = RunLoop(request_id="r", model="m", walk="w", loop=0, env={}, arrival=7)
    assert roundtrip(loop).arrival == 7.0 and type(roundtrip(loop).arrival) is float
    assert roundtrip(InvokeNode(request_id="r", node="m/n", call_index=0, inputs={})).arrival == 0.0
    consumer = RunConsumer(request_id="r", model="m", walk="w", stream=0, env={}, nonce="n", session="s", arrival=3.5)
    assert roundtrip(consumer).arrival == 3.5


def test_a_request_error_keeps_status_and_param_through_node_result_and_loop_done():
    fields = error_fields(RequestError("'x' must be positive", status=422, param="x"))
    for msg in (NodeResult(request_id="r", node="m/n", call_index=0, **fields),
                LoopDone(request_id="r", loop=0, node="n", **fields)):
        got = roundtrip(msg)
        err = remote_failure("n", "r", got.error, got.error_type, got.error_status, got.error_param)
        assert isinstance(err, RequestError) and (err.status, err.param) == (422, "x")


def test_other_failures_name_no_field():
    assert error_fields(ValueError("boom"))["error_param"] is None
    # a 500 is the node's own failure, not the client's field to fix
    assert error_fields(RequestError("bad", status=500, param="x"))["error_param"] is None
    err = remote_failure("n", "r", "boom", "ValueError", None, None)
    assert (err.status, err.param) == (500, None)


def test_priority_travels_on_calls_loops_and_consumers_and_defaults_to_zero():
    """A Batch API line's background class reaches a worker's schedulers (it ranks live calls first there too)."""
    from mstar_core.runtime.engine import BACKGROUND_PRIORITY

    call = InvokeNode(request_id="r", node="m/n", call_index=0, inputs={}, priority=BACKGROUND_PRIORITY + 0.5)
    assert roundtrip(call).priority == BACKGROUND_PRIORITY + 0.5
    assert roundtrip(RunLoop(request_id="r", model="m", walk="w", loop=0, env={},
                             priority=BACKGROUND_PRIORITY)).priority == BACKGROUND_PRIORITY
    consumer = RunConsumer(request_id="r", model="m", walk="w", stream=0, env={}, nonce="n", session="s",
                           priority=BACKGROUND_PRIORITY)
    assert roundtrip(consumer).priority == BACKGROUND_PRIORITY
    assert roundtrip(InvokeNode(request_id="r", node="m/n", call_index=0, inputs={})).priority == 0.0
