"""Tapes (`mstar_core.nn.tape`): CPU kernel calls recorded once, replayed from C over fresh inputs."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from mstar_core.nn import cpu_elementwise, native, tape
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.packed import pack_linears

pytestmark = pytest.mark.skipif(not tape.available(), reason="no C++ compiler here: tapes do not replay")


def _block(dtype: torch.dtype):
    """RMSNorm, a packed SwiGLU MLP and the residual add: the kernels of half a decoder layer."""
    torch.manual_seed(0)
    norm, mlp = RMSNorm(64).to(dtype), GatedMLP(64, 96).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    pack_linears(mlp)
    if mlp.gate_up_proj._fast is None or mlp.gate_up_proj._fast[6] is None:
        pytest.skip(f"no own {dtype} linear kernel on this CPU (oneDNN is a torch op)")

    def run(x: torch.Tensor) -> torch.Tensor:
        out = mlp(norm(x))
        assert cpu_elementwise.add_(out, x)
        return out

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_over_fresh_inputs_gives_the_eager_bits(dtype):
    run = _block(dtype)
    x = torch.randn(3, 64).to(dtype)
    recorded = tape.Tape()
    with torch.inference_mode(), recorded.recording():
        out = run(x)
    assert recorded.failure is None
    assert recorded.count == 5  # norm, gate/up, SiLU-mul, down, add
    assert any(kept.data_ptr() == out.data_ptr() for kept in recorded.keep)  # the output buffer outlives the run
    for seed in range(3):
        fresh = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
        x.copy_(fresh)
        recorded.replay()
        with torch.inference_mode():
            assert torch.equal(out, run(fresh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 13])  # (13: two row passes, the hint fetched over the last)
def test_each_linear_call_fetches_the_next_ones_weight_and_keeps_the_bits(dtype, rows):
    """A replayed linear is handed the next linear's weight to fetch near its end: only the cache changes, not a bit."""
    torch.manual_seed(0)
    mlp = GatedMLP(256, 1024).to(dtype)  # (wide enough that a one-row call runs on every thread)
    pack_linears(mlp)
    if mlp.gate_up_proj._fast is None or mlp.gate_up_proj._fast[6] is None:
        pytest.skip(f"no own {dtype} linear kernel on this CPU (oneDNN is a torch op)")
    x = torch.randn(rows, 256).to(dtype)
    recorded = tape.Tape()
    with torch.inference_mode(), recorded.recording():
        out = mlp(x)
    assert recorded.failure is None
    assert all(fetched == min(tape.NEXT_WEIGHT_BYTES, stride) for _, fetched, stride in recorded.next_weight_hints())
    recorded.hint_next_weights(256 << 10)
    (start, fetched, stride), last = recorded.next_weight_hints()
    assert start == mlp.down_proj._fast[6].data_ptr()  # gate/up's hint: down's weight; down's: none after it
    assert 0 < fetched == min(256 << 10, stride) and last[1] == 0
    for per_thread in (256 << 10, 0, 1 << 20):
        recorded.hint_next_weights(per_thread)
        fresh = torch.randn(rows, 256, generator=torch.Generator().manual_seed(per_thread)).to(dtype)
        x.copy_(fresh)
        recorded.replay()
        with torch.inference_mode():
            expected = mlp(fresh)
            assert torch.equal(out, expected)
            assert torch.equal(out[:1], mlp(fresh[:1]))  # (a row alone computes the same bits)


def test_the_hint_size_setting_is_checked(monkeypatch):
    monkeypatch.setenv(tape.NEXT_WEIGHT_ENV, "0")
    assert tape._next_weight_bytes() == 0
    monkeypatch.setenv(tape.NEXT_WEIGHT_ENV, "64k")
    with pytest.raises(ValueError, match=tape.NEXT_WEIGHT_ENV):
        tape._next_weight_bytes()


def test_a_timed_replay_names_each_call_and_gives_the_same_bits():
    run = _block(torch.float32)
    x = torch.randn(2, 64)
    recorded = tape.Tape()
    with torch.inference_mode(), recorded.recording():
        out = run(x)
    x.copy_(torch.randn(2, 64))
    timed = recorded.replay_timed()
    assert [name for name, _ in timed] == ["mstar_rms_norm_f32", "mstar_fp32_linear", "mstar_silu_mul_f32",
                                           "mstar_fp32_linear", "mstar_add_f32"]
    assert all(ns > 0 for _, ns in timed)
    with torch.inference_mode():
        assert torch.equal(out, run(x.clone()))


def test_a_torch_op_that_computes_spoils_the_recording():
    run = _block(torch.float32)
    x = torch.randn(2, 64)
    recorded = tape.Tape()
    with torch.inference_mode(), recorded.recording():
        run(x * 2)  # (the multiply runs while recording: a replay would skip it)
    assert "aten.mul" in recorded.failure
    with pytest.raises(RuntimeError, match="does not replay"):
        recorded.replay()


def test_views_and_allocations_do_not_spoil_it():
    x = torch.randn(4, 8)
    weight = torch.ones(8)
    recorded = tape.Tape()
    with torch.inference_mode(), recorded.recording():
        rows = x[1:3].view(2, 8)  # views and an allocation
        out = cpu_elementwise.rms_norm(rows, weight, 1e-6)
    assert recorded.failure is None and recorded.count == 1
    x[1:3] = torch.randn(2, 8)
    recorded.replay()
    torch.testing.assert_close(out, x[1:3] * torch.rsqrt(x[1:3].pow(2).mean(-1, keepdim=True) + 1e-6))


def test_other_threads_kernel_calls_are_not_recorded():
    x, weight = torch.randn(2, 8), torch.ones(8)
    recorded = tape.Tape()
    with recorded.recording():
        worker = threading.Thread(target=cpu_elementwise.rms_norm, args=(x, weight, 1e-6))
        worker.start()
        worker.join()
        cpu_elementwise.rms_norm(x, weight, 1e-6)
    assert recorded.failure is None and recorded.count == 1


def test_threads_record_their_own_tapes_at_once():
    """Two engines on two device threads may record at the same time: each tape gets its own thread's calls."""
    x, weight = torch.randn(2, 8), torch.ones(8)
    started, tapes = threading.Barrier(2), {}

    def record(name: str, calls: int) -> None:
        tapes[name] = tape.Tape()
        with tapes[name].recording():
            started.wait()
            for _ in range(calls):
                cpu_elementwise.rms_norm(x, weight, 1e-6)
            started.wait()

    threads = [threading.Thread(target=record, args=(name, calls)) for name, calls in (("a", 2), ("b", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (tapes["a"].count, tapes["b"].count) == (2, 3)
    assert native.RECORDER is None  # (cleared once no thread records)


def test_an_empty_recording_does_not_replay_and_tapes_do_not_nest():
    recorded = tape.Tape()
    with recorded.recording():
        with pytest.raises(RuntimeError, match="already recording"):
            with tape.Tape().recording():
                pass
    assert recorded.failure == "no kernel call"


def test_a_signature_tapes_do_not_know_spoils_the_recording():
    probe = native.function(tape.SOURCE, "mstar_tape_op_bytes", [], ctypes.c_int64)
    recorded = tape.Tape()
    with recorded.recording():
        recorded.record(probe, ())
    assert "signature" in recorded.failure


def test_gelu_layer_norm_and_cross_attention_calls_replay_with_the_eager_bits():
    """The calls a Whisper decoder step adds to a tape (issue 47): LayerNorm, GELU, the paged cross-attention."""
    from mstar_core.nn import gelu
    from mstar_core.nn.cross_attention import PagedCrossKernel
    from mstar_core.nn.layer_norm import layer_norm

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    keys, values = torch.randn(2, 12 * 16, 4, 16, generator=g)  # [slots, kv heads, head dim] in 16-slot pages
    table = [(0, 1, 40, [7, 2, 9]), (1, 1, 23, [4, 11])]
    kernel = PagedCrossKernel.for_spans(table, 16)
    if kernel is None or gelu._function(None) is None or layer_norm(keys[0, :1], w[:16], b[:16], 1e-5) is None:
        pytest.skip("a kernel is not built here")

    def run(x: torch.Tensor) -> torch.Tensor:
        h = layer_norm(x, w, b, 1e-5)
        assert gelu.gelu_(h) is h
        out = torch.empty(2, 4, 16)
        kernel(h.view(2, 4, 16), keys, values, out, 0.25)
        return out

    x = torch.randn(2, 64, generator=g)
    recorded = tape.Tape()
    with torch.inference_mode(), recorded.recording():
        out = run(x)
    assert recorded.failure is None and recorded.count == 3
    for seed in range(2):
        fresh = torch.randn(2, 64, generator=torch.Generator().manual_seed(seed + 1))
        x.copy_(fresh)
        recorded.replay()
        with torch.inference_mode():
            assert torch.equal(out, run(fresh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_replay_over_fresh_logits(dtype):
    """The argmax of `next_token.cpp` records like any kernel: a replay picks each row's index of the logits now in
    the recorded buffer (torch's first-maximum rule, as eager)."""
    from mstar_core.nn.logits import greedy_tokens

    logits = torch.randn(3, 1000).to(dtype)
    recorded = tape.Tape()
    with recorded.recording():
        tokens = greedy_tokens(logits)
    if tokens is None:
        pytest.skip("no C++ compiler here")
    assert recorded.failure is None and recorded.count == 1
    for seed in range(3):
        fresh = torch.randn(3, 1000, generator=torch.Generator().manual_seed(seed)).to(dtype)
        fresh[1] = fresh[1].round()  # ties: the first maximum
        logits.copy_(fresh)
        recorded.replay()
        assert torch.equal(tokens, fresh.float().max(-1).indices)
