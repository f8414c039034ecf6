"""Wide linears prepacked for oneDNN: same results as `F.linear` (fp32, a few ulps), never stale, invisible outside."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import DenseAttention, LlamaForCausalLM
from mstar_core.nn import packed as packed_mod
from mstar_core.nn.packed import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")

CFG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _close(a, b):
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item()), (a - b).abs().max()


def test_fp32_linears_at_least_min_out_wide_are_packed_and_match_f_linear():
    torch.manual_seed(0)
    wide, narrow, half = nn.Linear(32, 4096), nn.Linear(32, 64), nn.Linear(32, 4096).to(torch.bfloat16)
    model = nn.Sequential(wide, narrow, half)
    bf16 = packed_mod.bf16_packing_available()  # (a bf16 linear packs only where oneDNN runs bf16 here)
    assert pack_linears(model, min_out=2048) == 1 + bf16
    assert type(wide) is PackedLinear and type(narrow) is nn.Linear and type(half) is (PackedLinear if bf16 else nn.Linear)
    assert pack_linears(nn.Sequential(narrow)) == 1 and type(narrow) is PackedLinear  # by default every linear
    for rows in (1, 5, 32, 70):
        x = torch.randn(rows, 32)
        with torch.inference_mode():
            _close(wide(x), F.linear(x, wide.weight, wide.bias))
    x = torch.randn(2, 3, 32)  # leading dims kept
    with torch.inference_mode():
        assert wide(x).shape == (2, 3, 4096)
        _close(wide(x), F.linear(x, wide.weight, wide.bias))


def test_a_changed_weight_is_never_served_from_the_stale_pack():
    torch.manual_seed(0)
    layer = nn.Linear(16, 2048, bias=False)
    pack_linears(layer)
    x = torch.randn(4, 16)
    new = torch.randn(2048, 16)
    layer.load_state_dict({"weight": new})  # in place: bumps the weight's version
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, new))  # unpacked path: exactly F.linear
    layer.pack()
    with torch.inference_mode():
        _close(layer(x), F.linear(x, new))
    layer.weight = nn.Parameter(torch.randn(2048, 16))  # a new tensor altogether
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_autograd_copies_and_state_dict_see_a_plain_linear():
    torch.manual_seed(0)
    layer = nn.Linear(16, 2048)
    keys = list(layer.state_dict())
    pack_linears(layer)
    assert list(layer.state_dict()) == keys
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()  # grad mode: runs F.linear, gradients flow
    assert layer.weight.grad is not None and x.grad is not None
    twin = copy.deepcopy(layer)  # the opaque packed tensor is not copied; the copy runs unpacked
    with torch.inference_mode():
        assert torch.equal(twin(x.detach()), F.linear(x.detach(), layer.weight, layer.bias))


def test_packed_llama_matches_transformers(monkeypatch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()
    ours = LlamaForCausalLM(hf.config.to_dict())
    ours.load_state_dict(hf.state_dict(), strict=False)
    monkeypatch.setattr(packed_mod, "PACK_MIN_OUT", 1)
    assert pack_linears(ours) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    ids = torch.tensor([[3, 17, 99, 5, 250, 42, 7]])
    with torch.inference_mode():
        want = hf(ids).logits[0]
        hidden = ours(ids[0], torch.arange(ids.shape[1]), DenseAttention())
        _close(ours.compute_logits(hidden), want)


def test_engine_packs_on_cpu_unless_told_not_to_and_decodes_like_transformers(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from tests.engines.driver import generate, make_engine
    from tests.engines.helpers import hf_greedy, make_pair

    hf, ours = make_pair(tmp_path)
    monkeypatch.setattr(packed_mod, "PACK_MIN_OUT", 1)
    off = make_engine(copy.deepcopy(ours), num_pages=64, page_size=4, pack_weights=False)
    assert off.stats()["packed_linears"] == 0 and not any(isinstance(m, PackedLinear) for m in off.module.modules())
    engine = make_engine(ours, num_pages=64, page_size=4)
    assert engine.stats()["packed_linears"] == 2 * 4 + 1
    prompts = {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7]}
    got = generate(engine, prompts, 32)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(hf, prompt, 32), rid


def test_a_compiled_graph_keeps_the_packed_gemm_as_one_op():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 2048), nn.SiLU(), nn.Linear(2048, 4096, bias=False))
    assert pack_linears(model) == 2
    seen = []

    def backend(gm, example_inputs):  # records the traced graph, runs it as traced (no C++ compiler needed)
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x = torch.randn(5, 32)
    with torch.inference_mode():
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
        want = model(x)
    assert seen.count("mstar_nn.packed_linear") == 2, seen  # no graph break, no plain linear
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_tied_lm_head_is_packed_without_a_parameter_of_its_own(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from mstar_core.nn.tied_head import TiedLMHead

    monkeypatch.setattr(TiedLMHead, "PACK", False)
    assert pack_linears(LlamaForCausalLM({**CFG, "tie_word_embeddings": True}), min_out=512) == 0  # can be turned off
    monkeypatch.setattr(TiedLMHead, "PACK", True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CFG, "tie_word_embeddings": True})).eval()
    ours = LlamaForCausalLM(hf.config.to_dict())
    ours.load_state_dict(hf.state_dict(), strict=False)
    keys, params = list(ours.state_dict()), len(list(ours.parameters()))
    assert "lm_head.weight" not in keys
    assert pack_linears(ours, min_out=512) == 1  # the 64 x 512 head over the embedding's weight, nothing else
    assert list(ours.state_dict()) == keys and len(list(ours.parameters())) == params
    ids = torch.tensor([[3, 17, 99, 5, 250, 42, 7]])
    with torch.inference_mode():
        hidden = ours(ids[0], torch.arange(ids.shape[1]), DenseAttention())
        _close(ours.compute_logits(hidden), hf(ids).logits[0])
    new = torch.randn(512, 64)
    ours.model.embed_tokens.load_state_dict({"weight": new})  # in place: the pack is stale from now on
    with torch.inference_mode():
        assert torch.equal(ours.compute_logits(hidden), F.linear(hidden, new))
    ours.model.embed_tokens.weight = nn.Parameter(torch.randn(512, 64))  # replaced: the head follows the embedding
    with torch.inference_mode():
        assert torch.equal(ours.compute_logits(hidden), F.linear(hidden, ours.model.embed_tokens.weight))


@pytest.mark.skipif(not packed_mod.bf16_packing_available(), reason="oneDNN has no bf16 GEMM on this CPU (AVX2 only)")
def test_bf16_linears_pack_where_onednn_runs_bf16_and_match_f_linear():
    torch.manual_seed(0)
    layer = nn.Linear(64, 4096).to(torch.bfloat16)
    assert pack_linears(layer) == 1 and type(layer) is PackedLinear
    for rows in (1, 32):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        with torch.inference_mode():
            got, want = layer(x).float(), F.linear(x.float(), layer.weight.float(), layer.bias.float())
        # bf16 output rounding (8 bits of mantissa) on an fp32-accumulated sum
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_bf16_probe_is_a_bool_and_a_cpu_without_bf16_leaves_bf16_linears_plain():
    layer = nn.Linear(64, 4096).to(torch.bfloat16)
    got = pack_linears(layer)
    assert got == int(packed_mod.bf16_packing_available())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert layer(x).dtype == torch.bfloat16


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 4096)])
def test_a_packed_row_is_the_same_whatever_the_batchs_row_count(shape, threads):
    """Batch invariance: each row bitwise equal to that row alone (MKL's one-row GEMV breaks this; the pack keeps it)."""
    if not packing_available():
        pytest.skip("no oneDNN")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        layer = nn.Linear(*shape)
        assert pack_linears(layer) == 1
        x = torch.randn(300, shape[0])
        with torch.inference_mode():
            alone = torch.cat([layer(x[i : i + 1]) for i in range(0, 300, 7)])
            for rows in (2, 3, 8, 33, 300):
                got = layer(x[:rows])[::7]
                assert torch.equal(got, alone[: got.shape[0]]), rows
    finally:
        torch.set_num_threads(before)
