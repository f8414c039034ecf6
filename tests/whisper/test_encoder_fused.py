"""The encoder's fused q/k/v GEMM (derived at load by `pack_linears`) against the checkpoint's three linears."""

from __future__ import annotations

import torch
from mstar_whisper.modeling import EncoderLayer

from mstar_core.nn.packed import pack_linears, packing_available


def _layer(seed: int = 0) -> EncoderLayer:
    torch.manual_seed(seed)
    layer = EncoderLayer(64, 4, 128).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    return layer


def test_fused_qkv_equals_the_three_linears_bitwise():
    layer = _layer()
    pack_linears(layer)
    a = layer.self_attn
    assert ("fused_qkv" in a.__dict__) == packing_available()
    h = torch.randn(2, 37, 64)
    with torch.inference_mode():
        fused = a.qkv(h)
        apart = (a.q_proj(h), a.k_proj(h), a.v_proj(h))
    for got, want in zip(fused, apart, strict=True):
        assert torch.equal(got, want)
    # the derived copy is not a parameter: the checkpoint's names only
    assert not any("fused" in k for k in layer.state_dict())


def test_fused_qkv_follows_weights_loaded_after_packing():
    layer = _layer(0)
    pack_linears(layer)
    layer.load_state_dict(_layer(1).state_dict())  # new weights in place: the derived copy is stale, so unused
    a, h = layer.self_attn, torch.randn(1, 9, 64)
    with torch.inference_mode():
        got = a.qkv(h)
    want = (torch.nn.functional.linear(h, p.weight, p.bias) for p in (a.q_proj, a.k_proj, a.v_proj))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_packed_encoder_layer_matches_the_plain_one():
    plain, packed = _layer(2), _layer(2)
    pack_linears(packed)
    x = torch.randn(2, 50, 64)
    with torch.inference_mode():
        want, got = plain(x), packed(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # (autograd off but not inference mode: the in-place GELU and residual still apply)
        torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)  # recording a backward: out-of-place ops, gradients flow
    packed(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_fused_qkv_is_dropped_when_the_layer_changes_dtype():
    layer = _layer(3)
    pack_linears(layer)
    layer.to(torch.float64)  # new data under the same parameters: the fp32 copy no longer applies
    h = torch.randn(1, 5, 64, dtype=torch.float64)
    with torch.inference_mode():
        got = layer.self_attn.qkv(h)
    assert all(t.dtype == torch.float64 for t in got)
    torch.testing.assert_close(got[1], h @ layer.self_attn.k_proj.weight.t())
